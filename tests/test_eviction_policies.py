"""Eviction policies of the pool's free side (``lru``, ``slru``, ``s3fifo``, ``arc``) and scheduler hints.

1. Each policy's semantics through a real :class:`BlockPool`: SLRU promotion on a second touch,
   scan resistance, the protected cap and demotion, the ghost table; S3-FIFO's small/main FIFOs,
   lazy promotion and ghost returns; LRU is the historical free queue; option parsing.
2. Hints (``set_hints`` / ``declare_upcoming``) as a soft pin, under every policy.
3. A hypothesis state machine per policy over a :class:`KVCacheManager` mixing lookups,
   allocations, frees, evictions, resets, random declarations and refused calls: invariants after
   every step, every hit holds the request's own KV (content oracle), ``allocate_slots``
   succeeds exactly when the pool has the free blocks it needs, hinted blocks are reused last and
   uncached blocks first.
4. The scheduler replay: every policy with queue hints finishes every request, and the offline
   Belady bound in the real pool hits at least as much as LRU under cache pressure.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvcore import Request
from kvcore.block_pool import HINT_RESERVE_SHARE, BlockPool
from kvcore.errors import (
    BlockStateError,
    DoubleFreeError,
    InvalidArgumentError,
    InvariantError,
    NoFreeBlocksError,
    NullBlockError,
    UnknownRequestError,
)
from kvcore.eviction import REGISTRY, FreeBlockQueue, make_policy, parse_policy
from kvcore.eviction.arc import T1, T2, ARCPolicy
from kvcore.eviction.s3fifo import MAIN, SMALL, S3FIFOPolicy
from kvcore.eviction.segmented import CLEAN, NOT_FREE
from kvcore.eviction.slru import PROBATION, PROTECTED, SLRUPolicy
from kvcore.manager import KVCacheManager, add_construction_hook
from kvcore.sim.replay import ReplayConfig, ReplayResult, replay
from kvcore.sim.traces import TraceRequest
from kvcore.sim.workloads import multi_turn, random_prompts, shared_prefix
from kvcore.testing import ContentOracle, check_invariants, checked
from kvcore.types import BlockHash, KVCacheBlock, KVCacheBlocks
from tests.factories import (
    full_spec,
    ids,
    make_config,
    make_request,
    manager_snapshot,
    pool_snapshot,
)

POLICIES = ("lru", "slru", "s3fifo", "arc", "learned")
BS = 2  # block size of the pool-level tests


# -- helpers ------------------------------------------------------------------------------------

def tokens(tag: int, num_blocks: int) -> list[int]:
    """``num_blocks`` full blocks of tokens no other ``tag`` shares."""
    return [tag * 1000 + i for i in range(num_blocks * BS)]


def cache(pool: BlockPool, tag: int, num_blocks: int = 1,
          group_id: int = 0) -> tuple[Request, list[KVCacheBlock]]:
    """Allocate blocks for a request of ``num_blocks`` full blocks and cache them, as a manager
    does (the blocks stay in use)."""
    req = make_request(f"req{tag}", tokens(tag, num_blocks), BS)
    blocks = pool.get_new_blocks(num_blocks)
    pool.cache_full_blocks(req, blocks, 0, num_blocks, BS, group_id)
    return req, blocks


def release(pool: BlockPool, blocks: list[KVCacheBlock]) -> None:
    """Free a request's blocks tail first, as a manager does."""
    pool.free_blocks(list(reversed(blocks)))


def cached_free(pool: BlockPool, tag: int, num_blocks: int = 1) -> list[KVCacheBlock]:
    """Blocks caching a one-time prefix, freed."""
    _, blocks = cache(pool, tag, num_blocks)
    release(pool, blocks)
    return blocks


def is_cached(pool: BlockPool, h: BlockHash, block: KVCacheBlock | None = None) -> bool:
    found = pool.get_cached_block(h, [0])
    return found is not None and (block is None or found[0] is block)


def slru(pool: BlockPool) -> SLRUPolicy:
    policy = pool.policy
    assert isinstance(policy, SLRUPolicy)
    return policy


def s3fifo(pool: BlockPool) -> S3FIFOPolicy:
    policy = pool.policy
    assert isinstance(policy, S3FIFOPolicy)
    return policy


def arc(pool: BlockPool) -> ARCPolicy:
    policy = pool.policy
    assert isinstance(policy, ARCPolicy)
    return policy


def evict_by_pressure(pool: BlockPool) -> None:
    """Reuse every free block once (lazy eviction of every free cached block), then free them."""
    taken = pool.get_new_blocks(pool.num_free_blocks)
    pool.free_blocks(taken)


# == 1. policy semantics ==========================================================================

# -- SLRU ----------------------------------------------------------------------------------------

def test_slru_first_free_is_probation_and_a_hit_while_cached_protects() -> None:
    pool = BlockPool(9, eviction_policy="slru")
    policy = slru(pool)
    blocks = cached_free(pool, 1, 2)
    assert [policy.segment_of(b) for b in blocks] == [PROBATION, PROBATION]
    assert [policy.mark(b) for b in blocks] == [0, 0]
    pool.touch([blocks[0]])  # a prefix hit resurrects it
    assert policy.segment_of(blocks[0]) == NOT_FREE and policy.mark(blocks[0]) == 1
    pool.free_blocks([blocks[0]])
    assert policy.segment_of(blocks[0]) == PROTECTED
    assert policy.segment_of(blocks[1]) == PROBATION  # never hit
    check_invariants(pool)


def test_slru_a_block_shared_by_a_running_request_is_protected_on_its_free() -> None:
    pool = BlockPool(9, eviction_policy="slru")
    _, blocks = cache(pool, 1, 1)
    pool.touch(blocks)  # a second request hits it while the first still runs
    release(pool, blocks)
    assert slru(pool).segment_of(blocks[0]) == NOT_FREE  # one reference left
    release(pool, blocks)
    assert slru(pool).segment_of(blocks[0]) == PROTECTED
    check_invariants(pool)


def _hot_prefix_survives_a_scan(policy: str) -> bool:
    """A two-block prefix hit once while cached, then 40 one-time three-block requests."""
    pool = BlockPool(12, eviction_policy=policy)
    hot = cached_free(pool, 1, 2)
    hashes = [b.block_hash for b in hot]
    pool.touch(hot)
    release(pool, hot)
    for tag in range(100, 140):
        cached_free(pool, tag, 3)
        check_invariants(pool)
    return all(h is not None and is_cached(pool, h) for h in hashes)


def test_slru_s3fifo_and_arc_are_scan_resistant_lru_is_not() -> None:
    assert _hot_prefix_survives_a_scan("slru")
    assert _hot_prefix_survives_a_scan("s3fifo")
    assert _hot_prefix_survives_a_scan("arc")
    assert not _hot_prefix_survives_a_scan("lru")  # the scan is long enough to matter


def test_slru_protected_segment_is_capped_and_demotes_the_least_recent() -> None:
    pool = BlockPool(12, eviction_policy="slru:protected_share=0.3")
    policy = slru(pool)
    assert policy.protected_cap == 3  # int(0.3 * 11)
    protected: list[KVCacheBlock] = []
    for tag in range(6):
        block = cached_free(pool, tag, 1)[0]
        pool.touch([block])
        pool.free_blocks([block])
        protected.append(block)
        assert len(policy.queues()[PROTECTED]) <= policy.protected_cap
        check_invariants(pool)
    # The three most recently protected stay, in order; the others were demoted (oldest first)
    # to probation's tail and lost their mark.
    assert ids(list(policy.queues()[PROTECTED])) == ids(protected[3:])
    assert ids(list(policy.queues()[PROBATION])) == ids(protected[:3])
    assert [policy.mark(b) for b in protected[:3]] == [0, 0, 0]
    # A demoted block must be hit again to return (demoting the least recent protected one).
    pool.touch([protected[0]])
    pool.free_blocks([protected[0]])
    assert ids(list(policy.queues()[PROTECTED])) == ids([*protected[4:], protected[0]])
    assert policy.segment_of(protected[3]) == PROBATION
    # Victims: clean, then probation (demoted included), protected last.
    clean = len(policy.queues()[CLEAN])
    taken = pool.get_new_blocks(clean + 3)
    assert ids(taken[clean:]) == ids([protected[1], protected[2], protected[3]])
    check_invariants(pool)


def test_slru_protected_share_zero_protects_nothing() -> None:
    pool = BlockPool(8, eviction_policy="slru:protected_share=0")
    block = cached_free(pool, 1)[0]
    pool.touch([block])
    pool.free_blocks([block])
    assert slru(pool).segment_of(block) == PROBATION and slru(pool).mark(block) == 0
    check_invariants(pool)


@pytest.mark.parametrize("ghost_factor", [1, 0])
def test_slru_ghost_hash_re_cached_enters_protected(ghost_factor: int) -> None:
    pool = BlockPool(6, eviction_policy=f"slru:ghost_factor={ghost_factor}")
    policy = slru(pool)
    old = cached_free(pool, 1)[0]
    h = old.block_hash
    assert h is not None
    evict_by_pressure(pool)
    assert not is_cached(pool, h)
    assert policy.in_ghost(h) == bool(ghost_factor)
    _, again = cache(pool, 1)  # the same prefix comes back, in another block maybe
    assert again[0].block_hash == h
    release(pool, again)
    assert policy.segment_of(again[0]) == (PROTECTED if ghost_factor else PROBATION)
    assert not policy.in_ghost(h)  # recalled once
    check_invariants(pool)


def test_slru_ghost_also_remembers_explicit_evictions_and_forgets_old_ones() -> None:
    pool = BlockPool(11, eviction_policy="slru:ghost_factor=0.2")  # 2 remembered hashes
    policy = slru(pool)
    assert policy.ghost_capacity == 2
    blocks = [cached_free(pool, tag)[0] for tag in range(4)]
    hashes = [b.block_hash for b in blocks]
    pool.evict_blocks([b.block_id for b in blocks])  # evicted in order: 0, 1, 2, 3
    assert [h is not None and policy.in_ghost(h) for h in hashes] == [False, False, True, True]
    for tag in (0, 3):
        _, again = cache(pool, tag)
        release(pool, again)
        assert policy.segment_of(again[0]) == (PROTECTED if tag == 3 else PROBATION)
    check_invariants(pool)


# -- ARC -----------------------------------------------------------------------------------------

def test_arc_first_free_is_t1_a_hit_moves_to_t2() -> None:
    pool = BlockPool(9, eviction_policy="arc")
    policy = arc(pool)
    blocks = cached_free(pool, 1, 2)
    assert [policy.home(b) for b in blocks] == [T1, T1]
    assert [policy.segment_of(b) for b in blocks] == [T1, T1]
    pool.touch([blocks[0]])
    assert policy.segment_of(blocks[0]) == NOT_FREE and policy.home(blocks[0]) == T1
    assert policy.sizes == (2, 0)  # T1 counts its blocks in use too
    pool.free_blocks([blocks[0]])
    assert policy.home(blocks[0]) == T2 and policy.segment_of(blocks[0]) == T2
    assert policy.sizes == (1, 1)
    _, shared = cache(pool, 2)
    pool.touch(shared)  # shared by a running request before its first free
    release(pool, shared)
    release(pool, shared)
    assert policy.home(shared[0]) == T2
    check_invariants(pool)


def test_arc_victims_come_from_t1_while_it_is_over_its_target() -> None:
    pool = BlockPool(12, eviction_policy="arc")
    policy = arc(pool)
    hot = cached_free(pool, 1, 2)
    pool.touch(hot)
    release(pool, hot)
    cold = [cached_free(pool, tag)[0] for tag in range(10, 13)]
    assert policy.target == 0
    clean = len(policy.queues()[CLEAN])
    taken = pool.get_new_blocks(clean + 3)
    assert ids(taken[clean:]) == ids(cold)  # T1 (LRU order) before T2
    assert all(b.block_hash is not None and is_cached(pool, b.block_hash) for b in hot)
    assert policy.ghosts == (3, 0)
    check_invariants(pool)


def test_arc_ghost_hits_adapt_the_target_and_enter_t2() -> None:
    pool = BlockPool(12, eviction_policy="arc")
    policy = arc(pool)
    hot = cached_free(pool, 1)
    pool.touch(hot)
    release(pool, hot)  # T2
    cold = cached_free(pool, 2)  # T1
    pool.evict_blocks([cold[0].block_id, hot[0].block_id])  # cold -> B1, hot -> B2
    assert policy.ghosts == (1, 1) and policy.sizes == (0, 0)
    again = cached_free(pool, 2)  # T1 was too small: the target grows by max(|B2|/|B1|, 1)
    assert policy.home(again[0]) == T2 and policy.target == 1.0
    assert policy.ghosts == (0, 1)
    back = cached_free(pool, 1)  # T2 was too small: the target shrinks (not below 0)
    assert policy.home(back[0]) == T2 and policy.target == 0.0
    assert policy.ghosts == (0, 0)
    check_invariants(pool)


def test_arc_a_returning_hash_hit_while_in_use_is_still_a_ghost_hit() -> None:
    pool = BlockPool(12, eviction_policy="arc")
    policy = arc(pool)
    cold = cached_free(pool, 2)
    pool.evict_blocks([cold[0].block_id])  # -> B1
    assert policy.ghosts == (1, 0)
    _, again = cache(pool, 2)
    pool.touch(again)  # shared by a second request before its first free
    release(pool, again)
    release(pool, again)
    assert policy.home(again[0]) == T2
    assert policy.ghosts == (0, 0) and policy.target == 1.0  # the ghost hit adapted the target
    check_invariants(pool)


def test_arc_a_grown_target_keeps_t1_and_takes_t2_victims() -> None:
    pool = BlockPool(12, eviction_policy="arc")
    policy = arc(pool)
    recent = cached_free(pool, 1, 2)
    frequent = cached_free(pool, 2)
    pool.touch(frequent)
    release(pool, frequent)
    policy.target = 2.0  # as after ghost hits in B1
    clean = len(policy.queues()[CLEAN])
    taken = pool.get_new_blocks(clean + 1)
    assert ids(taken[clean:]) == ids(frequent)  # |T1| == target: T2 yields
    assert all(policy.home(b) == T1 for b in recent)
    assert policy.ghosts == (0, 1)
    check_invariants(pool)


def test_arc_ghost_lists_stay_within_arcs_bounds() -> None:
    pool = BlockPool(6, eviction_policy="arc")  # capacity 5
    policy = arc(pool)
    seen = [0, 0]
    for tag in range(40):
        blocks = cached_free(pool, tag, 2)
        if tag % 3 == 0:  # some prefixes are hit once: T2, and B2 after their eviction
            pool.touch(blocks)
            release(pool, blocks)
        t1, t2 = policy.sizes
        b1, b2 = policy.ghosts
        assert t1 + b1 <= 5 and t1 + t2 + b1 + b2 <= 10
        seen = [max(seen[0], b1), max(seen[1], b2)]
        check_invariants(pool)
    assert seen[0] > 0 and seen[1] > 0  # both ghost lists were used


# -- S3-FIFO -------------------------------------------------------------------------------------

def _into_main(pool: BlockPool, tags: list[int],
               hit: tuple[int, ...] = ()) -> list[KVCacheBlock]:
    """Blocks caching ``tags``' prefixes in main, in that order (each prefix comes back after
    an eviction); those of the tags in ``hit`` were also hit once while in use."""
    for tag in tags:
        cached_free(pool, tag)
    evict_by_pressure(pool)
    out = []
    for tag in tags:
        _, blocks = cache(pool, tag)
        if tag in hit:
            pool.touch(blocks)
            pool.free_blocks(blocks)
        out.append(blocks[0])
    release(pool, out[::-1])  # freed in tag order: the first tag is main's head
    return out


def test_s3fifo_ghost_returning_hash_enters_main() -> None:
    pool = BlockPool(12, eviction_policy="s3fifo")
    policy = s3fifo(pool)
    first = cached_free(pool, 1)[0]
    assert policy.segment_of(first) == SMALL
    main = _into_main(pool, [2, 3])
    assert [policy.segment_of(b) for b in main] == [MAIN, MAIN]
    check_invariants(pool)


def test_s3fifo_one_time_blocks_leave_small_before_main() -> None:
    pool = BlockPool(12, eviction_policy="s3fifo")
    policy = s3fifo(pool)
    assert policy.small_cap == 1  # int(0.1 * 11)
    main = _into_main(pool, [1, 2])
    small = [cached_free(pool, tag)[0] for tag in range(10, 14)]
    assert [policy.segment_of(b) for b in small] == [SMALL] * 4
    clean = len(policy.queues()[CLEAN])
    taken = pool.get_new_blocks(clean + 3)
    assert ids(taken[clean:]) == ids(small[:3])  # small's FIFO order, down to its cap
    assert all(b.block_hash is not None and is_cached(pool, b.block_hash) for b in main)
    assert policy.segment_of(small[3]) == SMALL
    # small is at its cap: main's head (never hit) is next, before small's last block.
    assert ids(pool.get_new_blocks(1)) == ids(main[:1])
    assert policy.segment_of(small[3]) == SMALL
    check_invariants(pool)


def test_s3fifo_a_hit_block_moves_to_main_instead_of_being_evicted() -> None:
    pool = BlockPool(12, eviction_policy="s3fifo")
    policy = s3fifo(pool)
    _, hit = cache(pool, 1)
    pool.touch(hit)  # shared while running: frequency 1
    pool.free_blocks(hit * 2)
    others = [cached_free(pool, tag)[0] for tag in range(10, 13)]
    assert policy.segment_of(hit[0]) == SMALL and policy.mark(hit[0]) == 1
    clean = len(policy.queues()[CLEAN])
    taken = pool.get_new_blocks(clean + 2)
    assert ids(taken[clean:]) == ids(others[:2])
    assert policy.segment_of(hit[0]) == MAIN and policy.mark(hit[0]) == 0
    assert hit[0].block_hash is not None and is_cached(pool, hit[0].block_hash, hit[0])
    check_invariants(pool)


def test_s3fifo_main_reinserts_a_hit_head_once_per_hit() -> None:
    pool = BlockPool(12, eviction_policy="s3fifo")
    policy = s3fifo(pool)
    hot, cold = _into_main(pool, [1, 2], hit=(1,))
    assert ids(list(policy.queues()[MAIN])) == ids([hot, cold])
    assert (policy.mark(hot), policy.mark(cold)) == (1, 0)
    clean = len(policy.queues()[CLEAN])
    taken = pool.get_new_blocks(clean + 1)
    # hot, main's head, was hit: reinserted at the tail with its frequency lowered instead.
    assert ids(taken[clean:]) == ids([cold])
    assert ids(list(policy.queues()[MAIN])) == ids([hot]) and policy.mark(hot) == 0
    assert ids(pool.get_new_blocks(1)) == ids([hot])  # the reinsertion bought one round
    check_invariants(pool)


# -- LRU -----------------------------------------------------------------------------------------

def test_lru_is_the_historical_free_queue() -> None:
    for pool in (BlockPool(8), BlockPool(8, eviction_policy="lru")):
        assert type(pool.policy) is FreeBlockQueue
        assert pool.eviction_policy == "lru"
        assert ids(list(pool.policy)) == list(range(1, 8))


class _QueueModel:
    """The historical free queue as a list: unhashed frees to the head (in the order given),
    hashed frees to the tail, hits unlink, reuse pops the head, evict_blocks leaves the block in
    place."""

    def __init__(self, n: int) -> None:
        self.queue = list(range(1, n))

    def take(self, n: int) -> list[int]:
        out, self.queue = self.queue[:n], self.queue[n:]
        return out

    def free(self, pool: BlockPool, ordered: list[KVCacheBlock]) -> None:
        head = [b.block_id for b in ordered if b.ref_cnt == 0 and b.block_hash is None]
        tail = [b.block_id for b in ordered if b.ref_cnt == 0 and b.block_hash is not None]
        self.queue = head + self.queue + tail


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(("alloc", "hit", "free", "evict")),
                          st.integers(0, 99), st.integers(1, 3)), max_size=40))
def test_lru_order_is_the_historical_free_queue_order(
        ops: list[tuple[str, int, int]]) -> None:
    pool = BlockPool(10, eviction_policy="lru")
    model = _QueueModel(10)
    held: list[list[KVCacheBlock]] = []  # one list per owner
    tag = 0
    for op, i, n in ops:
        if op == "alloc" and n <= pool.num_free_blocks:
            tag += 1
            req = make_request(f"o{tag}", tokens(tag % 4, 3)[:n * BS - (i % 2)], BS)
            blocks = pool.get_new_blocks(n)
            assert ids(blocks) == model.take(n)
            pool.cache_full_blocks(req, blocks, 0, req.num_tokens // BS, BS, 0)
            held.append(blocks)
        elif op == "hit":
            cached = [b for b in pool.blocks if b.block_hash is not None]
            if cached:
                block = cached[i % len(cached)]
                if block.ref_cnt == 0:
                    model.queue.remove(block.block_id)
                pool.touch([block])
                held.append([block])
        elif op == "free" and held:
            blocks = held.pop(i % len(held))
            release(pool, blocks)
            model.free(pool, blocks[::-1])
        elif op == "evict":
            pool.evict_blocks([1 + i % 9])
        assert ids(list(pool.policy)) == model.queue
        check_invariants(pool, {k: [b] for k, b in enumerate(held)})


# -- options -------------------------------------------------------------------------------------

def test_policy_options_are_parsed_and_applied() -> None:
    assert parse_policy("slru:protected_share=0.3,ghost_factor=2") == (
        "slru", {"protected_share": 0.3, "ghost_factor": 2.0})
    assert parse_policy(" s3fifo ") == ("s3fifo", {})
    policy = slru(BlockPool(12, eviction_policy="slru:protected_share=0.3,ghost_factor=2"))
    assert (policy.protected_cap, policy.ghost_capacity) == (3, 22)
    defaults = slru(BlockPool(12, eviction_policy="slru"))
    assert (defaults.protected_cap, defaults.ghost_capacity) == (5, 11)
    fifo = s3fifo(BlockPool(12, eviction_policy="s3fifo:small_share=0.5, ghost_factor=0"))
    assert (fifo.small_cap, fifo.ghost_capacity) == (5, 0)
    assert s3fifo(BlockPool(12, eviction_policy="s3fifo")).ghost_capacity == 5  # half of 11
    manager = KVCacheManager(make_config(full_spec(), num_blocks=12), 64,
                             eviction_policy="s3fifo:small_share=0.2")
    assert manager.pool.eviction_policy == "s3fifo"
    assert s3fifo(manager.pool).small_cap == 2


BAD_SPECS: list[tuple[object, tuple[str, ...]]] = [
    ("lirs", ("'lirs'",)),
    ("", ("''",)),
    (None, ("None",)),
    (3, ("3",)),
    ("slru:protected_share=2", ("protected_share", "2.0")),
    ("slru:protected_share=-0.1", ("protected_share", "-0.1")),
    ("slru:ghost_factor=65", ("ghost_factor", "65")),
    ("slru:ghost_factor=nan", ("ghost_factor", "nan")),
    ("slru:ghost_factor=inf", ("ghost_factor", "inf")),
    ("s3fifo:small_share=1.5", ("small_share", "1.5")),
    ("slru:protected_share", ("'protected_share'", "key=number")),
    ("slru:protected_share=abc", ("abc", "key=number")),
    ("slru:small_share=0.1", ("'slru'", "small_share")),
    ("s3fifo:protected_share=0.5", ("'s3fifo'", "protected_share")),
    ("lru:ghost_factor=2", ("'lru'", "ghost_factor")),
    ("arc:ghost_factor=2", ("'arc'", "ghost_factor")),
]


@pytest.mark.parametrize(("spec", "words"), BAD_SPECS, ids=[repr(s) for s, _ in BAD_SPECS])
def test_bad_policy_specs_are_refused_naming_the_value(spec: object,
                                                       words: tuple[str, ...]) -> None:
    bystander = BlockPool(8, eviction_policy="slru")
    cached_free(bystander, 1)
    before = pool_snapshot(bystander)
    registry = REGISTRY.names()
    with pytest.raises(InvalidArgumentError) as excinfo:
        BlockPool(8, eviction_policy=spec)
    for word in words:
        assert word in str(excinfo.value)
    with pytest.raises(InvalidArgumentError):
        KVCacheManager(make_config(full_spec(), num_blocks=8), 64, eviction_policy=spec)
    assert registry == REGISTRY.names()
    assert pool_snapshot(bystander) == before


def test_a_policy_factory_must_hold_the_blocks_it_was_given() -> None:
    with pytest.raises(InvalidArgumentError, match="EvictionPolicy holding the 7 blocks"):
        BlockPool(8, eviction_policy=lambda blocks: FreeBlockQueue(blocks[1:]))
    with pytest.raises(InvalidArgumentError):
        BlockPool(8, eviction_policy=lambda blocks: list(blocks))
    pool = BlockPool(8, eviction_policy=lambda blocks: make_policy("slru", blocks))
    assert pool.eviction_policy == "slru"


@pytest.mark.parametrize("spec", ["slru:ghost_factor=65", "slru:unknown=1",
                                  "slru:protected_share=2", "s3fifo:small_share=1.5",
                                  "learned:tau=0", "learned:deep_after=1.5",
                                  "learned:ghost_factor=-1"])
def test_a_refused_spec_leaves_the_blocks_as_they_were(spec: str) -> None:
    blocks = [KVCacheBlock(i) for i in range(1, 8)]
    for b in blocks:  # per-block policy state some other value than a new policy's
        b.policy_segment, b.policy_mark, b.policy_tag, b.policy_tail = 5, 1, 3, 1
    with pytest.raises(InvalidArgumentError):
        make_policy(spec, blocks)
    assert all(b.prev_free is None and b.next_free is None for b in blocks)
    assert all((b.policy_segment, b.policy_mark, b.policy_tag, b.policy_tail) == (5, 1, 3, 1)
               for b in blocks)
    assert len(make_policy("slru", blocks)) == 7  # the blocks can still build a policy


@pytest.mark.parametrize("policy", ("slru", "s3fifo", "arc", "learned"))
def test_a_segment_count_that_disagrees_with_its_links_is_caught(policy: str) -> None:
    """The policies that link blocks themselves keep each segment's count, and ``learned``'s
    victim search trusts it (a category's run is cut at its count, not at its list's end):
    check_invariants compares every segment's count with its links."""
    pool = BlockPool(12, eviction_policy=policy)
    cached_free(pool, 1, 3)
    check_invariants(pool)
    segment = next(q for q in pool.policy.queues()[1:] if len(q))
    assert isinstance(segment, FreeBlockQueue)
    segment.linked(1)  # one more than it links
    with pytest.raises(InvariantError,
                       match=r"\[queue-length\] len\(queue\) is 4 but 3 blocks are linked"):
        check_invariants(pool)


# == 2. hints ===================================================================================

@pytest.mark.parametrize("policy", POLICIES)
def test_hinted_blocks_are_reused_after_every_other_free_block(policy: str) -> None:
    pool = BlockPool(12, eviction_policy=policy)
    a = cached_free(pool, 1, 2)  # freed first: the first victims of every policy
    b = cached_free(pool, 2, 2)
    cached_free(pool, 3, 2)
    pool.set_hints([[h for h in (a[0].block_hash, a[1].block_hash) if h is not None]])
    assert sorted(ids(list(pool.reserve))) == sorted(ids(a))
    assert pool.num_free_blocks == 11 and len(pool.policy) == 9
    assert pool.hints == (frozenset(blk.block_hash for blk in a),)
    check_invariants(pool)
    taken = pool.get_new_blocks(9)
    assert not set(ids(a)) & set(ids(taken))
    assert all(blk.block_hash is not None and is_cached(pool, blk.block_hash, blk) for blk in a)
    assert not any(blk.block_hash is not None for blk in b)  # undeclared: evicted
    check_invariants(pool)
    # Nothing else is left: the reserve yields, least urgent (last declared) first.
    assert ids(pool.get_new_blocks(1)) == [a[1].block_id]
    assert ids(pool.get_new_blocks(1)) == [a[0].block_id]
    assert pool.num_free_blocks == 0 and len(pool.reserve) == 0
    with pytest.raises(NoFreeBlocksError):
        pool.get_new_blocks(1)
    check_invariants(pool)


@pytest.mark.parametrize("policy", POLICIES)
def test_a_block_freed_while_declared_goes_to_the_reserve(policy: str) -> None:
    pool = BlockPool(12, eviction_policy=policy)
    _, held = cache(pool, 1, 2)
    pool.set_hints([[held[1].block_hash]])  # type: ignore[list-item]  # cached: a hash
    assert len(pool.reserve) == 0  # in use: nothing to reserve yet
    release(pool, held)
    assert ids(list(pool.reserve)) == [held[1].block_id]
    assert held[0].block_id in ids(list(pool.policy))
    check_invariants(pool)


@pytest.mark.parametrize("policy", POLICIES)
def test_allocation_never_fails_while_free_blocks_exist_reserve_included(policy: str) -> None:
    pool = BlockPool(12, eviction_policy=policy)
    blocks = [cached_free(pool, tag, 1)[0] for tag in range(11)]
    pool.set_hints([[blk.block_hash for blk in blocks]])  # type: ignore[misc]  # cached
    reserved = len(pool.reserve)
    assert reserved > 0 and pool.num_free_blocks == 11
    pool.get_new_blocks(len(pool.policy))  # the policy has nothing left
    assert len(pool.policy) == 0 and pool.num_free_blocks == reserved
    before = pool_snapshot(pool)
    with pytest.raises(NoFreeBlocksError):
        pool.get_new_blocks(reserved + 1)
    assert pool_snapshot(pool) == before
    assert len(pool.get_new_blocks(reserved)) == reserved
    assert pool.num_free_blocks == 0
    check_invariants(pool)


@pytest.mark.parametrize("policy", POLICIES)
def test_manager_allocation_ignores_hints(policy: str) -> None:
    manager = KVCacheManager(make_config(full_spec(BS), num_blocks=12), 64,
                             eviction_policy=policy)
    done = []
    for tag in range(5):
        req = manager.make_request(f"d{tag}", tokens(tag, 2))
        assert manager.allocate_slots(req, req.num_tokens) is not None
        manager.free(req)
        done.append(req)
    manager.declare_upcoming(done)
    assert len(manager.pool.reserve) > 0 and manager.num_free_blocks == 11
    big = manager.make_request("big", tokens(9, 11))  # every block, the reserve included
    assert manager.allocate_slots(big, big.num_tokens) is not None
    assert manager.num_free_blocks == 0
    manager.check_invariants()
    manager.free(big)
    manager.check_invariants()


@pytest.mark.parametrize("policy", POLICIES)
def test_re_declaring_without_a_hash_returns_its_block_to_the_policy(policy: str) -> None:
    pool = BlockPool(12, eviction_policy=policy)
    a = cached_free(pool, 1, 2)
    ha = [blk.block_hash for blk in a]
    pool.set_hints([ha])  # type: ignore[list-item]  # cached: hashes
    assert sorted(ids(list(pool.reserve))) == sorted(ids(a))
    pool.set_hints([ha[1:]])  # type: ignore[list-item]
    assert ids(list(pool.reserve)) == [a[1].block_id]
    assert a[0].block_id in ids(list(pool.policy))
    check_invariants(pool)
    pool.set_hints([[]])
    assert len(pool.reserve) == 0 and pool.hints == (frozenset(),)
    assert set(ids(a)) <= set(ids(list(pool.policy)))
    assert pool.num_free_blocks == 11
    check_invariants(pool)


@pytest.mark.parametrize("policy", POLICIES)
def test_a_hit_on_a_reserved_block(policy: str) -> None:
    pool = BlockPool(12, eviction_policy=policy)
    a = cached_free(pool, 1, 2)
    pool.set_hints([[blk.block_hash for blk in a]])  # type: ignore[misc]  # cached
    pool.touch(a)
    assert [blk.ref_cnt for blk in a] == [1, 1]
    assert len(pool.reserve) == 0 and pool.num_free_blocks == 9
    check_invariants(pool, {"hit": [a]})
    release(pool, a)  # still declared: back to the reserve
    assert sorted(ids(list(pool.reserve))) == sorted(ids(a))
    check_invariants(pool)
    pool.set_hints([[]])  # back to the policy, which recorded the hit
    if policy == "slru":
        assert [slru(pool).segment_of(blk) for blk in a] == [PROTECTED, PROTECTED]
    elif policy == "s3fifo":
        assert [s3fifo(pool).mark(blk) for blk in a] == [1, 1]
    elif policy == "arc":
        assert [arc(pool).home(blk) for blk in a] == [T2, T2]
    check_invariants(pool)


@pytest.mark.parametrize("reserved", [False, True])
@pytest.mark.parametrize("policy", POLICIES)
def test_touching_a_block_twice_in_one_call(policy: str, reserved: bool) -> None:
    """``touch([b, b])`` takes two references whether ``b`` waits in the hint reserve or in the
    policy: the reserve changes eviction order, never the answer (it once raised on the second
    copy, leaving ``b`` out of the reserve with one reference)."""
    pool = BlockPool(12, eviction_policy=policy)
    a = cached_free(pool, 1, 2)
    if reserved:
        pool.set_hints([[a[0].block_hash]])  # type: ignore[list-item]  # cached: a hash
        assert ids(list(pool.reserve)) == [a[0].block_id]
    pool.touch([a[0], a[0]])
    assert a[0].ref_cnt == 2
    assert len(pool.reserve) == 0 and pool.num_free_blocks == 10
    check_invariants(pool, {"twice": [[a[0], a[0]]]})
    pool.free_blocks([a[0], a[0]])
    assert a[0].ref_cnt == 0 and pool.num_free_blocks == 11
    assert ids(list(pool.reserve)) == ([a[0].block_id] if reserved else [])
    check_invariants(pool)


@pytest.mark.parametrize("policy", POLICIES)
def test_manager_hit_adopts_reserved_blocks(policy: str) -> None:
    manager = KVCacheManager(make_config(full_spec(BS), num_blocks=12), 64,
                             eviction_policy=policy, verify_hits=True)
    first = manager.make_request("first", [*tokens(1, 3), 5])
    assert manager.allocate_slots(first, first.num_tokens) is not None
    manager.free(first)
    again = manager.make_request("again", [*tokens(1, 3), 6])
    manager.declare_upcoming([again])
    assert len(manager.pool.reserve) == 3
    hit_blocks, hit = manager.get_computed_blocks(again)
    assert hit == 6 and set(ids(list(hit_blocks[0]))) == set(ids(list(manager.pool.reserve)))
    assert manager.allocate_slots(again, again.num_tokens - hit, hit, hit_blocks) is not None
    assert len(manager.pool.reserve) == 0 and manager.num_free_blocks == 11 - 4
    manager.check_invariants()


@pytest.mark.parametrize("policy", POLICIES)
def test_evict_blocks_on_a_reserved_block(policy: str) -> None:
    pool = BlockPool(12, eviction_policy=policy)
    a = cached_free(pool, 1, 2)
    h0 = a[0].block_hash
    assert h0 is not None
    pool.set_hints([[h0, a[1].block_hash]])  # type: ignore[list-item]  # cached
    pool.evict_blocks([a[0].block_id])
    assert a[0].block_hash is None and not is_cached(pool, h0)
    assert ids(list(pool.reserve)) == [a[1].block_id]
    assert pool.policy.first() is a[0]  # no cache value left: reused first
    assert pool.num_free_blocks == 11
    check_invariants(pool)
    assert ids(pool.get_new_blocks(1)) == [a[0].block_id]
    check_invariants(pool)


@pytest.mark.parametrize("policy", POLICIES)
def test_reset_prefix_cache_clears_hints(policy: str) -> None:
    pool = BlockPool(12, eviction_policy=policy)
    a = cached_free(pool, 1, 2)
    declared = [blk.block_hash for blk in a]
    pool.set_hints([declared])  # type: ignore[list-item]  # cached
    _, held = cache(pool, 2)
    before = pool_snapshot(pool)
    assert not pool.reset_prefix_cache()  # a block in use: refused, hints kept
    assert pool_snapshot(pool) == before
    release(pool, held)
    assert pool.reset_prefix_cache()
    assert pool.hints == (frozenset(),) and len(pool.reserve) == 0
    assert pool.num_free_blocks == 11 and pool.num_cached_blocks() == 0
    check_invariants(pool)
    cached_free(pool, 1, 2)  # the same prefix, cached again: no hint survives the reset
    assert len(pool.reserve) == 0
    check_invariants(pool)


def test_hints_are_per_group() -> None:
    pool = BlockPool(12, num_groups=2, eviction_policy="slru")
    _, g0 = cache(pool, 1, 1, group_id=0)
    _, g1 = cache(pool, 1, 1, group_id=1)
    release(pool, g0)
    release(pool, g1)
    assert g0[0].block_hash == g1[0].block_hash
    pool.set_hints([[g0[0].block_hash], []])  # type: ignore[list-item]  # cached
    assert ids(list(pool.reserve)) == ids(g0)
    check_invariants(pool)


@pytest.mark.parametrize("policy", POLICIES)
def test_hints_with_caching_disabled_are_a_noop(policy: str) -> None:
    pool = BlockPool(12, enable_caching=False, eviction_policy=policy)
    release(pool, pool.get_new_blocks(3))
    before = pool_snapshot(pool)
    pool.set_hints([[BlockHash(b"\x01" * 16)]])
    assert pool.hints == (frozenset(),) and pool_snapshot(pool) == before
    manager = KVCacheManager(make_config(full_spec(BS), num_blocks=12), 64,
                             enable_caching=False, eviction_policy=policy)
    req = manager.make_request("a", tokens(1, 3))
    assert manager.allocate_slots(req, req.num_tokens) is not None
    manager.free(req)
    before = manager_snapshot(manager)
    manager.declare_upcoming([req])
    assert manager_snapshot(manager) == before
    manager.check_invariants()


def test_a_hit_on_a_reserved_block_leaves_the_protected_segment_alone() -> None:
    pool = BlockPool(6, eviction_policy="slru:protected_share=0.2")  # protected cap: 1 block
    policy = slru(pool)
    _, (protected,) = cache(pool, 1)
    pool.touch([protected])
    pool.free_blocks([protected, protected])  # hit while in use: protected on its free
    _, (hinted,) = cache(pool, 2)
    pool.touch([hinted])  # hit too, still in use
    pool.set_hints([[hinted.block_hash]])  # type: ignore[list-item]  # cached: a hash
    pool.free_blocks([hinted, hinted])  # to the reserve
    assert policy.segment_of(protected) == PROTECTED
    pool.touch([hinted])  # a prefix hit on the reserved block
    assert policy.segment_of(protected) == PROTECTED and policy.mark(protected) == 1


@pytest.mark.parametrize("bad", [None, 5, pytest.param(iter([[]]), id="iterator")])
def test_set_hints_refuses_a_non_sequence_with_a_typed_error(bad: object) -> None:
    pool = BlockPool(8)
    with pytest.raises(InvalidArgumentError):
        pool.set_hints(bad)  # type: ignore[arg-type]


# -- retention hint ------------------------------------------------------------------------------

def _freed_with(policy: str, retain: bool) -> tuple[KVCacheManager, list[KVCacheBlock]]:
    """A two-block request finished (freed) with or without the retention hint."""
    m = KVCacheManager(make_config(full_spec(BS), num_blocks=12), 64, eviction_policy=policy)
    req = m.make_request("chat-1", [*tokens(1, 2), 7])
    assert m.allocate_slots(req, req.num_tokens) is not None
    blocks = list(m.get_blocks("chat-1")[0])
    m.free(req, retain=retain)
    m.check_invariants()
    return m, blocks[:2]


def test_retention_hint_keeps_a_finished_prefix_as_reused() -> None:
    for retain, segment in ((False, PROBATION), (True, PROTECTED)):
        m, blocks = _freed_with("slru", retain)
        assert [slru(m.pool).segment_of(b) for b in blocks] == [segment, segment]
    m, blocks = _freed_with("arc", True)
    assert [arc(m.pool).home(b) for b in blocks] == [T2, T2]
    m, blocks = _freed_with("s3fifo", True)
    assert [s3fifo(m.pool).mark(b) for b in blocks] == [1, 1]
    # lru orders by recency only: the hint changes nothing.
    orders = [[b.block_id for b in _freed_with("lru", r)[0].pool.policy]
              for r in (False, True)]
    assert orders[0] == orders[1]


def test_retained_blocks_outlive_one_time_prefixes_under_slru() -> None:
    m, kept = _freed_with("slru", True)
    for tag in range(2, 12):  # one-time requests push the pool around
        req = m.make_request(f"once-{tag}", [*tokens(tag, 2), 7])
        assert m.allocate_slots(req, req.num_tokens) is not None
        m.free(req)
        m.check_invariants()
    assert all(b.block_hash is not None and is_cached(m.pool, b.block_hash, b) for b in kept)


def test_pool_retain_skips_free_uncached_and_null_blocks() -> None:
    pool = BlockPool(12, eviction_policy="slru")
    free = cached_free(pool, 1)
    _, used = cache(pool, 2)
    plain = pool.get_new_blocks(1)
    pool.retain([*free, *used, *plain, pool.null_block])
    policy = slru(pool)
    assert [policy.mark(b) for b in (*free, *used, *plain)] == [0, 1, 0]
    assert policy.segment_of(free[0]) == PROBATION
    check_invariants(pool)
    before = pool_snapshot(pool)
    with pytest.raises(BlockStateError):
        pool.retain([*used, BlockPool(4).blocks[1]])
    assert pool_snapshot(pool) == before and policy.mark(used[0]) == 1


@pytest.mark.parametrize("wrapped", [False, True])
def test_free_refuses_a_non_bool_retain_and_changes_nothing(wrapped: bool) -> None:
    m = KVCacheManager(make_config(full_spec(BS), num_blocks=12), 64, eviction_policy="slru")
    if wrapped:
        m = checked(m)
    req = m.make_request("r", [*tokens(1, 2), 7])
    assert m.allocate_slots(req, req.num_tokens) is not None
    before = manager_snapshot(m)
    for bad in ("yes", 1, None):
        with pytest.raises(InvalidArgumentError, match="retain"):
            m.free(req, retain=bad)  # type: ignore[arg-type]
        assert manager_snapshot(m) == before
    m.free(req, retain=True)
    assert m.num_running_requests == 0


def test_the_scheduler_retains_finished_requests_of_a_session() -> None:
    from kvcore.scheduler import Scheduler, SchedulerConfig

    for retain_sessions, session, segment in ((True, "chat", PROTECTED),
                                              (True, None, PROBATION),
                                              (False, "chat", PROBATION)):
        m = KVCacheManager(make_config(full_spec(4), num_blocks=12), 64, eviction_policy="slru")
        s = Scheduler(m, SchedulerConfig(retain_sessions=retain_sessions))
        req = m.make_request("turn-1", list(range(9)), max_tokens=1, ignore_eos=True,
                             session_id=session)
        s.add_request(req)
        s.update_from_output(s.schedule(), {"turn-1": 1})
        assert req.status.name == "FINISHED_LENGTH"
        first = m.pool.get_cached_block(req.block_hashes[0], [0])
        assert first is not None
        assert slru(m.pool).segment_of(first[0]) == segment, (retain_sessions, session)
    with pytest.raises(InvalidArgumentError, match="retain_sessions"):
        SchedulerConfig(retain_sessions="yes")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="session_id"):
        Request("x", [1, 2], session_id="")


def test_retention_helps_the_multi_turn_workload_under_pressure() -> None:
    """Conversations interleaved with one-time prompts, a cache too small for LRU to keep any
    turn until the next one: retaining each finished turn keeps some conversations (the hint
    reaches the policy through the scheduler replay)."""
    turns = multi_turn(num_conversations=8, turns=4, user_len=48, assistant_len=32,
                       think_ms=1500.0, interval_ms=40.0)
    noise = random_prompts(num_requests=60, min_len=128, max_len=384, output_len=8,
                           interval_ms=80.0)
    trace = sorted(turns + noise, key=lambda r: r.arrival_ms)
    rates = {}
    for retain in (False, True):
        result = replay(trace, ReplayConfig(block_size=16, num_blocks=96, max_num_seqs=8,
                                            eviction_policy="arc", retain_sessions=retain))
        assert result.num_finished == len(trace)
        rates[retain] = result.token_hit_rate
    assert rates[True] > rates[False]


# == 3. state machine ===========================================================================

MBS = 2  # block size
MNB = 12  # 11 usable blocks (22 tokens)
MML = 40  # decode may grow a request past what the pool holds
VOCAB = 3
FAMILIES = tuple(tuple((7 * f + 3 * i + i // 5) % VOCAB for i in range(16)) for f in range(3))
INDEX = st.integers(0, 99)
PROMPT = st.tuples(st.integers(0, 2), st.integers(0, 16),
                   st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=6))
RESERVE_CAP = int(HINT_RESERVE_SHARE * (MNB - 1))  # blocks hints may hold back from the policy
HOSTILE = ("double free", "pool double free", "unknown ids", "bad declare", "bad evict",
           "oversized", "bad retain")


class _NotARequest:
    """Has ``block_hashes``, but they are not hashes."""

    skip_reading_prefix_cache = False

    def __init__(self, hashes: list[object]) -> None:
        self.block_hashes = hashes


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class PolicyMachine(RuleBasedStateMachine):
    """A scheduler's calls over one full-attention manager with the class's ``policy``."""

    policy = "lru"

    @initialize(verify=st.booleans())
    def build(self, verify: bool) -> None:
        self.m = KVCacheManager(make_config(full_spec(MBS), num_blocks=MNB), MML,
                                eviction_policy=self.policy, verify_hits=verify)
        self.oracle = ContentOracle(self.m)
        self.known: list[Request] = []  # every request made: waiting, running or finished
        self.waiting: list[Request] = []
        self.running: dict[str, Request] = {}
        self.finished: list[Request] = []
        self.counter = 0

    # -- helpers ----------------------------------------------------------------------------------
    def _new_request(self, prompt: tuple[int, int, list[int]]) -> Request:
        family, keep, tail = prompt
        self.counter += 1
        return self.m.make_request(f"r{self.counter}", [*FAMILIES[family][:keep], *tail])

    def _refused(self, error: type[Exception], call: Callable[[], object], *words: str) -> None:
        """``call`` raises ``error`` (its message naming ``words``) and changes nothing."""
        before = manager_snapshot(self.m)
        with pytest.raises(error) as excinfo:
            call()
        for word in words:
            assert word in str(excinfo.value)
        assert manager_snapshot(self.m) == before, "a refused call changed the manager"

    def _free_side(self) -> tuple[set[int], set[int], set[int]]:
        """Ids of the blocks in the reserve, in the policy, and those of them without a hash."""
        pool = self.m.pool
        in_policy = {b.block_id for b in pool.policy}
        return ({b.block_id for b in pool.reserve}, in_policy,
                {bid for bid in in_policy if pool.blocks[bid].block_hash is None})

    def _check_victims(self, before: tuple[set[int], set[int], set[int]],
                       hit_ids: set[int]) -> None:
        """After a successful allocation: the free blocks it reused (hits excluded) came from
        the reserve only once the policy had none left, and (segmented policies) from the
        uncached blocks first."""
        reserve, in_policy, uncached = before
        blocks = self.m.pool.blocks
        reused = {bid for bid in reserve | in_policy if blocks[bid].ref_cnt > 0} - hit_ids
        if reused & reserve:
            assert in_policy - hit_ids <= reused, "a hinted block was reused before others"
        if reused - uncached and self.policy != "lru":  # lru leaves an evicted block in place
            assert uncached <= reused, "a cached block was reused before an uncached one"

    def _allocate(self, req: Request, n: int, hit: int = 0,
                  blocks: KVCacheBlocks | None = None) -> bool:
        """allocate_slots for ``n`` more tokens (after a hit of ``hit`` tokens in ``blocks`` for a
        new request), which must succeed exactly when enough blocks are free."""
        start = req.num_computed_tokens + hit
        hit_blocks = tuple(blocks[0]) if blocks is not None else ()
        held = len(self.m.get_blocks(req.request_id)[0]) if req.request_id in self.running else 0
        need = (_cdiv(start + n, MBS) - held - len(hit_blocks)
                + sum(1 for b in hit_blocks if b.ref_cnt == 0))
        free = self.m.num_free_blocks
        before = manager_snapshot(self.m)
        side = self._free_side()
        out = self.m.allocate_slots(req, n, hit, blocks)
        assert (out is not None) == (need <= free), (
            f"allocate_slots needing {need} blocks with {free} free returned {out}")
        if out is None:
            assert manager_snapshot(self.m) == before, "a None allocation changed the manager"
            return False
        self._check_victims(side, {b.block_id for b in hit_blocks})
        self.oracle.written(req, start, start + n)
        req.num_computed_tokens = start + n
        return True

    def _admit(self, req: Request, chunk: int) -> bool:
        blocks, hit = self.m.get_computed_blocks(req)
        assert len(blocks[0]) * MBS == hit < req.num_tokens
        self.oracle.check_hit(req, blocks, hit)  # the hit holds this request's own KV
        if not self._allocate(req, max(1, min(chunk, req.num_tokens - hit)), hit, blocks):
            return False
        if req in self.waiting:
            self.waiting.remove(req)
        self.running[req.request_id] = req
        return True

    def _free(self, req: Request, preempt: bool, retain: bool = False) -> None:
        blocks = list(self.m.get_blocks(req.request_id)[0])
        self.m.free(req, retain=retain)
        del self.running[req.request_id]
        pool = self.m.pool
        if len(pool.reserve) < RESERVE_CAP:  # the cap returned none: every hinted block is held
            reserved = {b.block_id for b in pool.reserve}
            for b in blocks:
                h = b.block_hash
                if b.ref_cnt == 0 and h in pool.hints[0] and is_cached(pool, h, b):
                    assert b.block_id in reserved, "a freed hinted block is not in the reserve"
        if preempt:
            req.num_computed_tokens = 0
            req.num_preemptions += 1
            self.waiting.append(req)
        else:
            self.finished.append(req)

    # -- valid ------------------------------------------------------------------------------------
    @rule(prompt=PROMPT)
    def add(self, prompt: tuple[int, int, list[int]]) -> None:
        req = self._new_request(prompt)
        self.known.append(req)
        self.waiting.append(req)

    @rule(prompt=PROMPT)
    def serve(self, prompt: tuple[int, int, list[int]]) -> None:
        """A whole request at once: look up, prefill, finish (fills the cache quickly)."""
        req = self._new_request(prompt)
        self.known.append(req)
        if self._admit(req, req.num_tokens):
            self._free(req, preempt=False)
        else:
            self.waiting.append(req)

    @precondition(lambda self: bool(self.waiting))
    @rule(i=INDEX, chunk=st.integers(1, 24))
    def admit(self, i: int, chunk: int) -> None:
        self._admit(self.waiting[i % len(self.waiting)], chunk)

    @precondition(lambda self: bool(self.running))
    @rule(i=INDEX, chunk=st.integers(1, 12), token=st.integers(0, VOCAB - 1))
    def step(self, i: int, chunk: int, token: int) -> None:
        req = self.running[sorted(self.running)[i % len(self.running)]]
        if req.num_computed_tokens < req.num_tokens:
            n = min(chunk, req.num_tokens - req.num_computed_tokens)
        elif req.num_tokens < MML:
            req.append_output_token_ids(token)
            n = 1
        else:
            return
        self._allocate(req, n)

    @precondition(lambda self: bool(self.running))
    @rule(i=INDEX, preempt=st.booleans(), retain=st.booleans())
    def free(self, i: int, preempt: bool, retain: bool) -> None:
        """Finish or preempt a running request, with or without the retention hint."""
        self._free(self.running[sorted(self.running)[i % len(self.running)]], preempt, retain)

    @rule(data=st.data(), fresh=st.booleans())
    def declare(self, data: st.DataObject, fresh: bool) -> None:
        """Declare a random list of requests: waiting, running, finished, or (``fresh``) one the
        manager never saw, with nothing cached."""
        picks = (data.draw(st.lists(st.sampled_from(self.known), max_size=6))
                 if self.known else [])
        if fresh:
            picks.append(self._new_request(data.draw(PROMPT)))
        pool = self.m.pool

        def observed() -> object:
            lookups = [(ids(list(blocks[0])), n) for blocks, n in
                       map(self.m.get_computed_blocks, self.waiting)]
            return (lookups, [(b.ref_cnt, b.block_hash) for b in pool.blocks],
                    self.m.num_free_blocks)

        before = observed()
        self.m.declare_upcoming(picks)
        declared = frozenset(h for r in picks for h in r.block_hashes)
        assert pool.hints == (declared,)
        # Hints change eviction order only: no lookup, free count, reference or hash changes.
        assert observed() == before
        # The reserve holds the free blocks a lookup of a declared hash would hit (as many as
        # the reserve's cap allows).
        hittable = set()
        for h in declared:
            found = pool.get_cached_block(h, [0])
            if found is not None and found[0].ref_cnt == 0:
                hittable.add(found[0].block_id)
        reserved = {b.block_id for b in pool.reserve}
        assert reserved <= hittable
        assert len(reserved) == min(len(hittable), RESERVE_CAP)

    @rule(block_ids=st.lists(st.integers(1, MNB - 1), min_size=1, max_size=3),
          reset=st.sampled_from((False, False, False, True)))
    def evict_or_reset(self, block_ids: list[int], reset: bool) -> None:
        if not reset:
            self.m.evict_blocks(block_ids)
            return
        assert self.m.reset_prefix_cache() == (not self.running)
        if not self.running:
            assert self.m.pool.hints == (frozenset(),) and len(self.m.pool.reserve) == 0
            assert self.m.pool.num_cached_blocks() == 0

    # -- refused --------------------------------------------------------------------------------
    @rule(how=st.sampled_from(HOSTILE), i=INDEX, prompt=PROMPT)
    def hostile(self, how: str, i: int, prompt: tuple[int, int, list[int]]) -> None:
        m = self.m
        if how == "double free" and self.finished:
            req = self.finished[i % len(self.finished)]
            self._refused(UnknownRequestError, lambda: m.free(req), req.request_id)
        elif how == "pool double free" and self.running:
            blocks = list(m.get_blocks(sorted(self.running)[i % len(self.running)])[0])
            refs = blocks * (1 + max(b.ref_cnt for b in blocks))
            self._refused(DoubleFreeError, lambda: m.pool.free_blocks(refs))
        elif how == "unknown ids":
            stranger = self._new_request(prompt)
            self._refused(UnknownRequestError, lambda: m.free(stranger), stranger.request_id)
            self._refused(UnknownRequestError, lambda: m.get_blocks("nope"), "nope")
            self._refused(UnknownRequestError, lambda: m.num_slots("nope"), "nope")
        elif how == "bad declare":
            req = self.known[i % len(self.known)] if self.known else self._new_request(prompt)
            bad: object = ("abc", b"ab", 5, None, [req, "run"], [req, 3],
                           [req, _NotARequest([1, 2])])[i % 7]
            self._refused(InvalidArgumentError,
                          lambda: m.declare_upcoming(bad))  # type: ignore[arg-type]
        elif how == "bad evict":
            self._refused(NullBlockError, lambda: m.evict_blocks([0]))
            self._refused(InvalidArgumentError, lambda: m.evict_blocks([1, MNB + i]),
                          str(MNB + i))
        elif how == "bad retain" and self.running:
            req = self.running[sorted(self.running)[i % len(self.running)]]
            self._refused(InvalidArgumentError, lambda: m.free(req, retain="yes"),  # type: ignore[arg-type]
                          "retain", "'yes'")
            stranger = BlockPool(4).blocks[1]
            self._refused(BlockStateError, lambda: m.pool.retain([stranger]))
        elif how == "oversized":  # more blocks than the pool has: None, nothing changed
            req = self.m.make_request("big", [*self._new_request(prompt).all_token_ids,
                                              *[1] * (MNB * MBS)][:MML])
            before = manager_snapshot(m)
            assert m.allocate_slots(req, req.num_tokens) is None
            assert manager_snapshot(m) == before
            self._refused(InvalidArgumentError, lambda: m.allocate_slots(req, MML + 1),
                          "max_model_len")

    # -- checks -------------------------------------------------------------------------------------
    @invariant()
    def consistent(self) -> None:
        self.m.check_invariants()
        for req in self.running.values():
            self.oracle.check_table(req)
        assert self.m.pool.num_rejected_hits == 0  # real hashes: no hit is another prefix
        assert self.m.pool.eviction_policy == self.policy.partition(":")[0]  # (name, no options)
        assert len(self.m.pool.reserve) <= RESERVE_CAP

    def teardown(self) -> None:
        if not hasattr(self, "m"):
            return
        for req in self.m.requests().values():
            self.m.free(req)
        self.m.check_invariants()
        assert self.m.num_free_blocks == MNB - 1
        everything = self.m.pool.get_new_blocks(MNB - 1)  # the reserve included
        self.m.pool.free_blocks(everything)
        self.m.check_invariants()


MACHINE_SETTINGS = settings(max_examples=60, stateful_step_count=50, deadline=None,
                            suppress_health_check=[HealthCheck.too_slow])


def _policy_machine(policy: str) -> type[PolicyMachine]:
    machine: type[PolicyMachine] = type(f"PolicyMachine[{policy}]", (PolicyMachine,),
                                        {"policy": policy})
    machine.TestCase.settings = MACHINE_SETTINGS
    return machine


TestLRUMachine = _policy_machine("lru").TestCase
TestSLRUMachine = _policy_machine("slru").TestCase
TestS3FIFOMachine = _policy_machine("s3fifo").TestCase
TestARCMachine = _policy_machine("arc").TestCase
TestLearnedMachine = _policy_machine("learned").TestCase
# (deep categories from the first block past a hit prefix: the machine's prompts are short)
TestLearnedDeepMachine = _policy_machine("learned:deep_after=1").TestCase


# == 4. scheduler replay ========================================================================

def _workload() -> list[TraceRequest]:
    return shared_prefix(num_groups=6, prompts_per_group=6, system_len=96, question_len=32,
                         output_len=8, interval_ms=5.0)


def _replay(policy: str, queue_hints: int, num_blocks: int = 40) -> ReplayResult:
    return replay(_workload(), ReplayConfig(block_size=16, num_blocks=num_blocks, max_num_seqs=4,
                                            max_num_batched_tokens=256,
                                            eviction_policy=policy, queue_hints=queue_hints))


@contextmanager
def _every_manager_checked() -> Iterator[list[KVCacheManager]]:
    """Check the invariants and the KV of every hit and table after every call of the managers
    built inside (the replay builds its own)."""
    built: list[KVCacheManager] = []

    def hook(manager: KVCacheManager) -> None:
        built.append(checked(manager, track_contents=True))

    remove = add_construction_hook(hook)
    try:
        yield built
    finally:
        remove()


@pytest.mark.parametrize("policy", POLICIES)
def test_replay_with_queue_hints_finishes_every_request(policy: str) -> None:
    baseline = _replay("lru", 0)
    unhinted = _replay(policy, 0)
    with _every_manager_checked() as built:
        result = _replay(policy, 4)
    assert len(built) == 1 and built[0].pool.eviction_policy == policy
    assert result.num_rejected == 0 and result.num_finished == result.num_requests
    assert result.num_finished == baseline.num_finished == len(_workload())
    assert baseline.evicted_blocks > 0 and result.evicted_blocks > 0  # under cache pressure
    # The hints took effect: on this workload they keep the next groups' system prompts.
    assert result.token_hit_rate > unhinted.token_hit_rate


def test_a_pool_running_the_offline_bound_passes_its_invariants() -> None:
    from kvcore.sim.oracle import ReplayBelady

    manager = KVCacheManager(make_config(full_spec(BS), num_blocks=8), 64,
                             eviction_policy=ReplayBelady)
    req = manager.make_request("a", [*tokens(1, 2), 5])
    assert manager.allocate_slots(req, req.num_tokens) is not None
    manager.free(req)
    manager.check_invariants()


@pytest.mark.parametrize("drop", ["evict_blocks", "reset_prefix_cache"])
def test_the_offline_bound_survives_evictions_and_resets(drop: str) -> None:
    from kvcore.sim.oracle import ReplayBelady

    manager = KVCacheManager(make_config(full_spec(BS), num_blocks=8), 64,
                             eviction_policy=ReplayBelady)
    req = manager.make_request("a", [*tokens(1, 2), 5])
    assert manager.allocate_slots(req, req.num_tokens) is not None
    cached = [b.block_id for b in manager.get_blocks("a")[0] if b.block_hash is not None]
    policy = manager.pool.policy
    assert isinstance(policy, ReplayBelady)
    policy.uses = {h: [5] for h in req.block_hashes}  # needed again by request 5: kept longer
    manager.free(req)
    if drop == "evict_blocks":
        manager.evict_blocks(cached)
    else:
        assert manager.reset_prefix_cache()
    policy.advance(0, req.block_hashes)  # the replay's call when a request is admitted
    manager.check_invariants()
    other = manager.make_request("b", [*tokens(2, 1), 5])  # a cached block with no next use
    assert manager.allocate_slots(other, other.num_tokens) is not None
    manager.free(other)
    hashed = [b.block_hash is not None for b in policy]  # in reuse order
    assert any(hashed) and hashed == sorted(hashed)  # every uncached block is reused first
    manager.check_invariants()


def test_belady_bound_hits_at_least_as_much_as_lru_under_pressure() -> None:
    lru = _replay("lru", 0)
    belady = _replay("belady", 0)
    assert lru.evicted_blocks > 0
    assert belady.num_finished == lru.num_finished == lru.num_requests
    assert belady.token_hit_rate >= lru.token_hit_rate
    assert belady.token_hit_rate > lru.token_hit_rate  # on this workload it is strictly better


def test_reuse_oracle_evicts_blocks_never_needed_again_first() -> None:
    lru = _replay("lru", 0)
    with _every_manager_checked() as built:
        oracle = _replay("reuse_oracle", 0)
    assert built and oracle.num_finished == lru.num_requests
    assert lru.token_hit_rate <= oracle.token_hit_rate <= _replay("belady", 0).token_hit_rate
    # The pool itself refuses it (it reads the future): only the replay and simulator run it.
    with pytest.raises(InvalidArgumentError, match="reuse_oracle"):
        KVCacheManager(make_config(full_spec(2), num_blocks=8), 40, eviction_policy="reuse_oracle")
    with pytest.raises(InvalidArgumentError, match=r"reuse_oracle.*'lpm'"):
        replay(_workload(), ReplayConfig(num_blocks=40, eviction_policy="reuse_oracle",
                                         schedule_policy="lpm"))


def test_redeclaring_reorders_the_reserve_by_urgency() -> None:
    """A block kept from an earlier declaration is re-ranked by the new one: past the reserve's
    cap, the least urgent declared block yields, not the one declared first."""
    m = KVCacheManager(make_config(full_spec(2), num_blocks=12), 40)  # reserve cap: 5 blocks

    def serve(rid: str, tokens: list[int]) -> Request:
        r = m.make_request(rid, tokens)
        assert m.allocate_slots(r, r.num_tokens) is not None
        m.free(r)
        return r

    big = serve("big", [1, 2, 3, 4, 5, 6, 7, 8])  # 4 cached blocks
    mid = serve("mid", [9, 9])
    low = serve("low", [8, 8])
    m.declare_upcoming([mid])
    m.declare_upcoming([big, mid, low])  # most urgent first
    held = {b.block_id for b in m.pool.reserve}

    def block_of(r: Request) -> int:
        found = m.pool.get_cached_block(r.block_hashes[0], [0])
        assert found is not None
        return found[0].block_id

    assert block_of(mid) in held and block_of(low) not in held
    m.check_invariants()


def test_the_scheduler_redeclares_when_the_waiting_head_changes_content() -> None:
    """A new request with as many hashes as an aborted one replaces its hints (the scheduler
    names the waiting head by its last chained hashes, so even a recycled object address, which
    this test cannot force, is not mistaken for an unchanged head)."""
    from kvcore.scheduler import Scheduler, SchedulerConfig

    m = KVCacheManager(make_config(full_spec(4), num_blocks=12), 64, queue_hints=1)
    s = Scheduler(m, SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=64))
    run = m.make_request("run", list(range(8)), max_tokens=20, ignore_eos=True)
    s.add_request(run)
    s.update_from_output(s.schedule(), {"run": 1})
    a = m.make_request("a", [100 + i for i in range(8)], max_tokens=2, ignore_eos=True)
    s.add_request(a)
    s.update_from_output(s.schedule(), {"run": 1})
    assert m.pool.hints[0] == frozenset(a.block_hashes)
    s.abort_request("a")
    b = m.make_request("b", [200 + i for i in range(8)], max_tokens=2, ignore_eos=True)
    assert len(b.block_hashes) == len(a.block_hashes)
    s.add_request(b)
    s.update_from_output(s.schedule(), {"run": 1})
    assert m.pool.hints[0] == frozenset(b.block_hashes)


# -- ghosts are per group --------------------------------------------------------------------------

GHOST_HOMES = {"slru": (PROBATION, PROTECTED), "s3fifo": (SMALL, MAIN), "arc": (T1, T2)}


@pytest.mark.parametrize("name", sorted(GHOST_HOMES))
def test_ghost_tables_are_keyed_by_group_and_hash(name: str) -> None:
    """Two groups cache the same prefix (one hash, two blocks).  Evicting group 0's copy makes
    only group 0's return a ghost hit: group 1's copy, freed for the first time, is new."""
    first_time, returned = GHOST_HOMES[name]
    pool = BlockPool(12, num_groups=2, eviction_policy=name)
    policy = pool.policy
    assert isinstance(policy, (SLRUPolicy, S3FIFOPolicy, ARCPolicy))
    _, (in_group0,) = cache(pool, 0, group_id=0)
    _, (in_group1,) = cache(pool, 0, group_id=1)
    h = in_group0.block_hash
    assert h is not None and in_group1.block_hash == h
    release(pool, [in_group0])
    pool.evict_blocks([in_group0.block_id])  # group 0's copy is now a ghost
    check_invariants(pool)
    release(pool, [in_group1])
    assert policy.segment_of(in_group1) == first_time
    # The same prefix cached again in group 0 is a ghost return there.
    _, (again,) = cache(pool, 0, group_id=0)
    release(pool, [again])
    assert policy.segment_of(again) == returned
    check_invariants(pool)
