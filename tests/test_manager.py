"""KVCacheManager: the vLLM behaviours schedulers rely on, with a full-attention group of
block size 4 unless a test says otherwise."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

import pytest

from kvcore import Request
from kvcore.errors import InvalidArgumentError, UnknownRequestError
from kvcore.events import BlockRemoved, BlockStored
from kvcore.manager import KVCacheManager
from kvcore.types import KVCacheBlocks
from tests.factories import (
    ManagerOptions,
    admit,
    decode,
    full_spec,
    make_manager,
    manager_snapshot,
    swa_spec,
)

if TYPE_CHECKING:
    from typing_extensions import Unpack

BS = 4


def mgr(num_blocks: int = 16, max_model_len: int = 1024,
        **kw: Unpack[ManagerOptions]) -> KVCacheManager:
    return make_manager(full_spec(BS), num_blocks=num_blocks, max_model_len=max_model_len, **kw)


def test_first_allocation_returns_ids_one_to_n() -> None:
    m = mgr()
    r = m.make_request("a", range(10))
    blocks, hit = m.get_computed_blocks(r)
    assert hit == 0 and blocks == KVCacheBlocks([()])
    out = m.allocate_slots(r, 10)
    assert out is not None and out.get_block_ids() == ([1, 2, 3],)
    assert m.get_block_ids("a") == ([1, 2, 3],)
    m.check_invariants()


def test_free_order_is_eviction_order() -> None:
    m = mgr(num_blocks=10)
    r = m.make_request("a", range(10))  # blocks 1, 2 full (cached); 3 partial
    admit(m, r)
    m.free(r)
    order = [b.block_id for b in m.pool.policy]
    assert order == [3, 4, 5, 6, 7, 8, 9, 2, 1]
    other = m.make_request("b", range(100, 136))
    admit(m, other)
    assert m.get_block_ids("b") == ([3, 4, 5, 6, 7, 8, 9, 2, 1],)
    m.check_invariants()


def test_shared_prefix_hit_has_ref_cnt_two() -> None:
    m = mgr()
    a = m.make_request("a", range(12))
    admit(m, a)
    b = m.make_request("b", [*range(8), 50, 51, 52, 53, 54])
    blocks, hit = m.get_computed_blocks(b)
    assert hit == 8 and [x.block_id for x in blocks[0]] == [1, 2]
    assert [x.ref_cnt for x in blocks[0]] == [1, 1]  # lookup alone takes no reference
    m.allocate_slots(b, b.num_tokens - hit, hit, blocks)
    assert [m.pool.blocks[i].ref_cnt for i in (1, 2, 3)] == [2, 2, 1]
    assert m.get_block_ids("b") == ([1, 2, 4, 5],)
    assert m.get_num_common_prefix_blocks("a") == [2]
    m.check_invariants()


def test_prefix_hit_after_first_request_finished() -> None:
    m = mgr()
    a = m.make_request("a", range(13))
    admit(m, a)
    m.free(a)
    b = m.make_request("b", range(13))
    blocks, hit = m.get_computed_blocks(b)
    assert hit == 12 and [x.block_id for x in blocks[0]] == [1, 2, 3]
    assert all(x.ref_cnt == 0 for x in blocks[0])  # cached but free
    free_before = m.num_free_blocks
    out = m.allocate_slots(b, 1, hit, blocks)
    assert out is not None and out.get_block_ids() == ([4],)
    assert m.num_free_blocks == free_before - 4  # three resurrected + one new
    m.check_invariants()


def test_last_prompt_token_is_never_a_hit() -> None:
    m = mgr()
    a = m.make_request("a", range(12))
    admit(m, a)
    m.free(a)
    same = m.make_request("b", range(12))  # fully cached prompt
    _, hit = m.get_computed_blocks(same)
    assert hit == 8  # 11 tokens may hit; block-aligned: 8
    out = m.allocate_slots(same, 4, 8, m.get_computed_blocks(same)[0])
    assert out is not None
    # The recomputed last block is a fresh block, not the cached one.
    assert m.get_block_ids("b")[0][:2] == [1, 2] and m.get_block_ids("b")[0][2] != 3
    m.check_invariants()


def test_decode_fills_and_caches_a_block() -> None:
    m = mgr(enable_events=True)
    r = m.make_request("a", range(6))
    admit(m, r)
    assert m.pool.blocks[1].block_hash is not None and m.pool.blocks[2].block_hash is None
    m.take_events()
    decode(m, r, 100)  # 7 tokens
    assert m.take_events() == []
    decode(m, r, 101)  # 8 tokens: block 2 is full now
    assert m.pool.blocks[2].block_hash == r.block_hashes[1]
    (ev,) = m.take_events()
    assert isinstance(ev, BlockStored) and ev.token_ids == (4, 5, 100, 101)
    assert ev.parent_block_hash == r.block_hashes[0] and ev.group_id == 0
    decode(m, r, 102)  # 9 tokens: a new block
    assert m.get_block_ids("a") == ([1, 2, 3],)
    m.check_invariants()


def test_partial_block_ids_name_the_block_a_step_completes() -> None:
    m = make_manager(full_spec(BS), swa_spec(4, BS), num_blocks=32, max_model_len=1024)
    r = m.make_request("a", range(14))
    admit(m, r)  # 14 tokens: blocks 0..3 per group
    m.remove_skipped_blocks("a", 14)  # the window (4) no longer reaches blocks 0 and 1
    full, swa = m.get_block_ids("a")
    assert swa[:2] == [0, 0] and m.get_partial_block_ids("a", 13) == [full[3], swa[3]]
    assert m.get_partial_block_ids("a", 12) == []  # a block boundary: nothing partly filled
    assert m.get_partial_block_ids("a", 2) == [full[0]]  # the window's block is null
    assert m.get_partial_block_ids("a", 17) == []  # beyond the allocated blocks


def test_preemption_then_rehit() -> None:
    m = mgr(num_blocks=8)
    r = m.make_request("a", range(14))
    admit(m, r)
    decode(m, r, 7)
    m.free(r)  # preempted: recompute later
    r.num_computed_tokens = 0
    r.num_preemptions += 1
    blocks, hit = m.get_computed_blocks(r)
    assert hit == 12 and [b.block_id for b in blocks[0]] == [1, 2, 3]
    m.allocate_slots(r, r.num_tokens - hit, hit, blocks)
    m.record_prefix_cache_stats(r, hit)
    assert m.get_block_ids("a")[0][:3] == [1, 2, 3]
    stats = m.make_prefix_cache_stats()
    assert stats is not None
    assert (stats.requests, stats.queries, stats.hits) == (1, 14, 0)
    assert (stats.preempted_requests, stats.preempted_queries, stats.preempted_hits) == (1, 15, 12)
    m.check_invariants()


def test_failed_allocation_changes_nothing_byte_for_byte() -> None:
    m = mgr(num_blocks=6)  # 5 usable
    a = m.make_request("a", range(12))
    admit(m, a)
    m.free(a)
    b = m.make_request("b", range(8))
    admit(m, b)  # hits blocks 1 (and 2? no: 7 tokens may hit -> 1 block)
    c = m.make_request("c", [*range(8), *range(200, 220)])
    blocks, hit = m.get_computed_blocks(c)
    assert hit == 8
    before = manager_snapshot(m)
    assert m.allocate_slots(c, c.num_tokens - hit, hit, blocks) is None
    assert manager_snapshot(m) == before
    # A running request growing past the pool also fails cleanly.
    b.append_output_token_ids(list(range(300, 330)))
    before = manager_snapshot(m)
    assert m.allocate_slots(b, 30) is None
    assert manager_snapshot(m) == before
    m.check_invariants()


def test_full_sequence_must_fit_gates_admission() -> None:
    m = mgr(num_blocks=6)  # 5 usable
    r = m.make_request("a", range(24))  # needs 6 blocks in all
    assert m.allocate_slots(r, 8, full_sequence_must_fit=True) is None
    assert m.allocate_slots(r, 8) is not None  # the first chunk alone fits
    small = m.make_request("b", range(4))
    assert m.allocate_slots(small, 4, full_sequence_must_fit=True) is not None
    m.check_invariants()


def test_lookahead_slots_are_allocated_but_never_cached() -> None:
    m = mgr()
    r = m.make_request("a", range(8))
    out = m.allocate_slots(r, 8, num_lookahead_tokens=5)
    assert out is not None and len(out[0]) == 4  # 13 slots
    r.num_computed_tokens = 8
    hashed = [b for b in m.get_blocks("a")[0] if b.block_hash is not None]
    assert len(hashed) == 2  # only the real tokens' full blocks
    m.check_invariants()


def test_delay_cache_blocks_then_cache_blocks() -> None:
    m = mgr()
    r = m.make_request("a", range(9))
    m.allocate_slots(r, 9, delay_cache_blocks=True)
    assert all(b.block_hash is None for b in m.get_blocks("a")[0])
    m.cache_blocks(r, 9)
    assert [b.block_hash is not None for b in m.get_blocks("a")[0]] == [True, True, False]
    r.num_computed_tokens = 9
    m.check_invariants()


def test_external_computed_tokens_get_fresh_blocks_and_are_cached() -> None:
    m = mgr()
    a = m.make_request("a", range(8))
    admit(m, a)
    b = m.make_request("b", range(20))
    blocks, hit = m.get_computed_blocks(b)
    assert hit == 8
    out = m.allocate_slots(b, 4, hit, blocks, num_external_computed_tokens=8)
    assert out is not None
    assert m.get_block_ids("b") == ([1, 2, 3, 4, 5],)  # 2 hits, 2 external, 1 new
    assert out.get_block_ids() == ([5],)
    b.num_computed_tokens = 20
    assert all(blk.block_hash is not None for blk in m.get_blocks("b")[0])
    m.check_invariants()


def test_caching_disabled() -> None:
    m = mgr(enable_caching=False)
    a = m.make_request("a", range(12))
    admit(m, a)
    m.free(a)
    b = m.make_request("b", range(12))
    blocks, hit = m.get_computed_blocks(b)
    assert hit == 0 and not any(blocks)
    assert all(blk.block_hash is None for blk in m.pool.blocks)
    assert m.make_prefix_cache_stats() is not None
    m.check_invariants()


def test_reset_prefix_cache() -> None:
    m = mgr(enable_events=True)
    a = m.make_request("a", range(12))
    admit(m, a)
    assert m.reset_prefix_cache() is False
    m.free(a)
    assert m.reset_prefix_cache() is True
    stats = m.make_prefix_cache_stats()
    assert stats is not None and stats.reset
    b = m.make_request("b", range(12))
    assert m.get_computed_blocks(b)[1] == 0
    assert m.take_events()[-1].__class__.__name__ == "AllBlocksCleared"


def test_events_carry_group_ids() -> None:
    from tests.factories import swa_spec

    m = make_manager(full_spec(BS), swa_spec(8, BS), num_blocks=21, enable_events=True)
    r = m.make_request("a", range(8))
    admit(m, r)
    events = m.take_events()
    stored = [e for e in events if isinstance(e, BlockStored)]
    assert Counter(e.group_id for e in stored) == {0: 1, 1: 1}
    m.free(r)
    # 20 blocks: 16 never used, then the 4 cached ones (2 per group) are reused and evicted.
    assert m.allocate_slots(m.make_request("x", range(1000, 1040)), 40) is not None
    removed = [e for e in m.take_events() if isinstance(e, BlockRemoved)]
    assert Counter(e.group_id for e in removed) == {0: 2, 1: 2}


def test_stats_count_admissions_not_lookups() -> None:
    # As vLLM: a query is counted once, when the request is admitted; lookups of a request that
    # does not fit (a scheduler retries them every step) are not queries.
    m = mgr(num_blocks=6)
    a = m.make_request("a", range(12))
    admit(m, a)
    b = m.make_request("b", range(12))
    assert admit(m, b, 4) is not None  # hits 8
    big = m.make_request("big", range(100, 120))
    for _ in range(3):
        assert admit(m, big) is None
    m.get_computed_blocks(m.make_request("peek", range(12)))  # a lookup alone counts nothing
    stats = m.make_prefix_cache_stats()
    assert stats is not None and (stats.requests, stats.queries, stats.hits) == (2, 24, 8)
    assert stats.hit_rate == pytest.approx(8 / 24)
    with pytest.raises(InvalidArgumentError):
        m.record_prefix_cache_stats(b, -1)
    fresh = m.make_prefix_cache_stats()
    assert fresh is not None and fresh.requests == 0
    assert mgr(log_stats=False).make_prefix_cache_stats() is None


def test_verify_hits_rejects_planted_collision() -> None:
    m = mgr(verify_hits=True)
    a = m.make_request("a", range(12))
    admit(m, a)
    m.free(a)
    b = m.make_request("b", [*range(100, 112)])
    # Plant a collision: b's block hashes are made to equal a's.
    b.block_hashes[:] = list(a.block_hashes)
    blocks, hit = m.get_computed_blocks(b)
    assert hit == 0 and not any(blocks)
    assert m.pool.num_rejected_hits == 1
    # Without verification the same plant is (wrongly) a hit.
    m2 = mgr()
    a2 = m2.make_request("a", range(12))
    admit(m2, a2)
    b2 = m2.make_request("b", [*range(100, 112)])
    b2.block_hashes[:] = list(a2.block_hashes)
    assert m2.get_computed_blocks(b2)[1] == 8
    # Genuine hits still pass verification.
    c = m.make_request("c", range(12))
    assert m.get_computed_blocks(c)[1] == 8


def test_requests_without_hasher_are_hashed_by_the_manager() -> None:
    m = mgr()
    a = m.make_request("a", range(12))
    admit(m, a)
    plain = Request("p", list(range(12)))  # no block hasher
    assert plain.block_hashes == []
    assert m.get_computed_blocks(plain)[1] == 8
    assert plain.block_hashes == a.block_hashes


def test_hash_seed_separates_managers() -> None:
    m1, m2 = mgr(hash_seed=1), mgr(hash_seed=2)
    assert m1.make_request("a", range(8)).block_hashes != m2.make_request("a", range(8)).block_hashes


# -- bad input ------------------------------------------------------------------------------------

def test_bad_counts_and_lengths_raise_and_change_nothing() -> None:
    m = mgr(max_model_len=16)
    r = m.make_request("a", range(10))
    admit(m, r)
    before = manager_snapshot(m)
    for kwargs in ({"num_new_tokens": -1}, {"num_new_tokens": 1, "num_lookahead_tokens": -2},
                   {"num_new_tokens": 0}, {"num_new_tokens": 7},  # 10 + 7 > 16
                   {"num_new_tokens": 1.5}):
        with pytest.raises(InvalidArgumentError):
            m.allocate_slots(r, **kwargs)
    long = m.make_request("b", range(20))
    with pytest.raises(InvalidArgumentError, match="max_model_len"):
        m.allocate_slots(long, 20)
    with pytest.raises(InvalidArgumentError, match="running"):
        m.allocate_slots(r, 1, 4, KVCacheBlocks([m.get_blocks("a")[0][:1]]))
    with pytest.raises(InvalidArgumentError, match="per group"):
        m.allocate_slots(m.make_request("c", range(4)), 4, 0, KVCacheBlocks([(), ()]))
    assert manager_snapshot(m) == before


def test_unknown_and_double_freed_requests() -> None:
    m = mgr()
    r = m.make_request("a", range(6))
    with pytest.raises(UnknownRequestError):
        m.free(r)
    admit(m, r)
    m.free(r)
    before = manager_snapshot(m)
    with pytest.raises(UnknownRequestError, match="already freed"):
        m.free(r)
    with pytest.raises(KeyError):
        m.get_block_ids("a")
    with pytest.raises(UnknownRequestError):
        m.cache_blocks(r, 4)
    with pytest.raises(UnknownRequestError):
        m.get_num_common_prefix_blocks("zzz")
    assert manager_snapshot(m) == before


def test_another_prefixs_hit_is_refused_as_a_different_prefix() -> None:
    """Handing request b the hit request a got: the error says the blocks belong to a different
    prefix (not that they were evicted), and nothing changes."""
    from kvcore.errors import InvalidHitError
    from tests.factories import make_config

    m = KVCacheManager(make_config(full_spec(4), num_blocks=16), 64)
    first = m.make_request("first", list(range(12)))
    assert m.allocate_slots(first, 12) is not None
    m.free(first)
    a = m.make_request("a", list(range(12)))
    hit, n = m.get_computed_blocks(a)
    assert n == 8
    b = m.make_request("b", list(range(100, 112)))
    m.get_computed_blocks(b)
    with pytest.raises(InvalidHitError, match="different prefix") as excinfo:
        m.allocate_slots(b, 4, n, hit)
    assert "evicted" not in str(excinfo.value).split("(")[0]
    assert m.num_running_requests == 0
    m.check_invariants()
