"""BlockPool semantics that vLLM users rely on, and bad input leaving the pool unchanged."""

from __future__ import annotations

import pytest

from kvcore import Request
from kvcore.block_pool import BlockPool
from kvcore.errors import (
    BlockStateError,
    DoubleFreeError,
    InvalidArgumentError,
    InvalidGroupError,
    NoFreeBlocksError,
    NullBlockError,
)
from kvcore.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvcore.testing import check_invariants
from kvcore.types import KVCacheBlock
from kvcore.verify import PrefixChains
from tests.factories import ids, make_request, pool_snapshot


def cached_request_blocks(pool: BlockPool, rid: str, tokens: list[int], bs: int = 4,
                          group_id: int = 0) -> tuple[Request, list[KVCacheBlock]]:
    """Allocate blocks for ``tokens`` and cache the full ones, as a manager would."""
    req = make_request(rid, tokens, bs)
    blocks = pool.get_new_blocks(-(-len(tokens) // bs))
    pool.cache_full_blocks(req, blocks, 0, len(tokens) // bs, bs, group_id)
    return req, blocks


def test_construction_takes_null_block() -> None:
    pool = BlockPool(8)
    assert pool.null_block.block_id == 0 and pool.null_block.is_null
    assert pool.num_free_blocks == 7
    assert ids(list(pool.policy)) == list(range(1, 8))
    assert pool.usage == 0.0
    check_invariants(pool)


@pytest.mark.parametrize("bad", [0, 1, -3, 2.5, "8", True])
def test_bad_pool_size(bad: object) -> None:
    with pytest.raises(InvalidArgumentError):
        BlockPool(bad)  # type: ignore[arg-type]


def test_first_allocation_returns_ids_one_to_n() -> None:
    pool = BlockPool(10)
    blocks = pool.get_new_blocks(4)
    assert ids(blocks) == [1, 2, 3, 4]
    assert all(b.ref_cnt == 1 for b in blocks)
    assert ids(pool.get_new_blocks(2)) == [5, 6]
    assert pool.usage == pytest.approx(6 / 9)
    check_invariants(pool)


def test_free_tail_first_puts_unhashed_at_head_hashed_at_tail() -> None:
    pool = BlockPool(10)
    # 10 tokens with block size 4: blocks 1, 2 full (hashed), block 3 partial (unhashed).
    _, blocks = cached_request_blocks(pool, "a", list(range(10)))
    assert ids(blocks) == [1, 2, 3]
    pool.free_blocks(list(reversed(blocks)))  # a request frees tail-first
    order = ids(list(pool.policy))
    assert order[0] == 3  # unhashed: reused first
    assert order[-2:] == [2, 1]  # hashed: evicted last, the prefix's head last of all
    assert order == [3, 4, 5, 6, 7, 8, 9, 2, 1]
    # Free order equals eviction order: allocating everything drains in exactly that order.
    assert ids(pool.get_new_blocks(9)) == order
    check_invariants(pool)


def test_unhashed_frees_are_lifo_at_head() -> None:
    pool = BlockPool(6)
    a = pool.get_new_blocks(2)
    pool.free_blocks(reversed(a))
    assert ids(list(pool.policy))[:2] == [2, 1]
    assert ids(pool.get_new_blocks(1)) == [2]


def test_cached_free_block_is_found_and_resurrected_by_touch() -> None:
    pool = BlockPool(8)
    req, blocks = cached_request_blocks(pool, "a", list(range(8)))
    pool.free_blocks(reversed(blocks))
    h0 = req.block_hashes[0]
    hit = pool.get_cached_block(h0, [0])
    assert hit is not None and hit[0] is blocks[0] and hit[0].ref_cnt == 0
    free_before = pool.num_free_blocks
    pool.touch(hit)
    assert blocks[0].ref_cnt == 1
    assert blocks[0].prev_free is None and blocks[0].next_free is None
    assert pool.num_free_blocks == free_before - 1
    assert blocks[0] not in list(pool.policy)
    pool.touch(hit)  # a second sharer: ref_cnt 2, queue unchanged
    assert blocks[0].ref_cnt == 2 and pool.num_free_blocks == free_before - 1
    check_invariants(pool, {"r1": [blocks[0]], "r2": [blocks[0]]})


def test_reused_block_loses_old_hash_and_emits_block_removed() -> None:
    pool = BlockPool(4, enable_events=True)  # 3 usable blocks
    req, blocks = cached_request_blocks(pool, "a", list(range(8)))
    stored = pool.take_events()
    assert stored == [BlockStored(block_hashes=tuple(req.block_hashes), parent_block_hash=None,
                                  token_ids=tuple(range(8)), block_size=4, group_id=0,
                                  extra_keys=(None, None))]
    pool.free_blocks(reversed(blocks))
    assert ids(list(pool.policy)) == [3, 2, 1]
    reused = pool.get_new_blocks(2)  # 3 (never hashed) then 2 (hash of block index 1)
    assert ids(reused) == [3, 2]
    assert blocks[1].block_hash is None
    assert pool.get_cached_block(req.block_hashes[1], [0]) is None
    assert pool.get_cached_block(req.block_hashes[0], [0]) == [blocks[0]]
    assert pool.take_events() == [BlockRemoved(block_hashes=(req.block_hashes[1],), group_id=0)]
    assert pool.num_evicted_blocks == 1
    assert pool.take_events() == []
    check_invariants(pool)


def test_hash_in_group_zero_never_hits_in_group_one() -> None:
    pool = BlockPool(8, num_groups=2)
    req, _ = cached_request_blocks(pool, "a", list(range(4)), group_id=0)
    h = req.block_hashes[0]
    assert pool.get_cached_block(h, [0]) is not None
    assert pool.get_cached_block(h, [1]) is None
    assert pool.get_cached_block(h, [0, 1]) is None
    _, b1 = cached_request_blocks(pool, "b", list(range(4)), group_id=1)
    got = pool.get_cached_block(h, [0, 1])
    assert got is not None and got[1] is b1[0] and got[0] is not got[1]
    check_invariants(pool)


def test_duplicate_hashes_share_a_key_and_survive_eviction_of_either() -> None:
    pool = BlockPool(6, enable_events=True)
    req, a = cached_request_blocks(pool, "a", list(range(4)))
    _, b = cached_request_blocks(pool, "b", list(range(4)))
    h = req.block_hashes[0]
    assert pool.get_cached_block(h, [0]) == [a[0]]  # the earliest cached block wins
    pool.evict_blocks([a[0].block_id])
    assert pool.get_cached_block(h, [0]) == [b[0]]
    pool.evict_blocks([b[0].block_id])
    assert pool.get_cached_block(h, [0]) is None
    assert pool.num_cached_blocks() == 0
    check_invariants(pool)


def test_duplicates_promoted_in_insertion_order() -> None:
    pool = BlockPool(8)
    reqs = [cached_request_blocks(pool, f"r{i}", list(range(4))) for i in range(3)]
    h = reqs[0][0].block_hashes[0]
    first, second, third = (r[1][0] for r in reqs)
    pool.evict_blocks([second.block_id])
    assert pool.get_cached_block(h, [0]) == [first]
    pool.evict_blocks([first.block_id])
    assert pool.get_cached_block(h, [0]) == [third]
    check_invariants(pool)


def test_caching_is_idempotent_for_the_same_hash() -> None:
    pool = BlockPool(6, enable_events=True)
    req, blocks = cached_request_blocks(pool, "a", list(range(8)))
    pool.take_events()
    pool.cache_full_blocks(req, blocks, 0, 2, 4, 0)
    assert pool.take_events() == []
    assert pool.num_cached_blocks() == 2
    check_invariants(pool)


def test_cache_full_blocks_only_new_range_and_parent_hash() -> None:
    pool = BlockPool(8, enable_events=True)
    req = make_request("a", list(range(6)), 4)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(req, blocks, 0, 1, 4, 0)
    req.append_output_token_ids([6, 7, 8])
    assert len(req.block_hashes) == 2
    pool.cache_full_blocks(req, blocks, 1, 2, 4, 0)
    events = pool.take_events()
    assert len(events) == 2
    second = events[1]
    assert isinstance(second, BlockStored)
    assert second.parent_block_hash == req.block_hashes[0]
    assert second.block_hashes == (req.block_hashes[1],)
    assert second.token_ids == (4, 5, 6, 7)
    check_invariants(pool)


def test_null_blocks_are_skipped_by_touch_free_and_cache() -> None:
    pool = BlockPool(6)
    req = make_request("a", list(range(8)), 4)
    null = pool.null_block
    (b,) = pool.get_new_blocks(1)
    pool.cache_full_blocks(req, [null, b], 0, 2, 4, 0)
    assert null.block_hash is None and b.block_hash == req.block_hashes[1]
    pool.touch([null, b])
    assert b.ref_cnt == 2 and null.ref_cnt == 0
    pool.free_blocks([null, b, null])
    assert b.ref_cnt == 1 and null.ref_cnt == 0
    check_invariants(pool, {"a": [null, b]})


def test_evicting_the_null_block_is_rejected() -> None:
    pool = BlockPool(4)
    before = pool_snapshot(pool)
    with pytest.raises(NullBlockError):
        pool.evict_blocks([1, 0])
    with pytest.raises(InvalidArgumentError):
        pool.evict_blocks([1, 9])
    assert pool_snapshot(pool) == before


def test_reset_prefix_cache_refuses_while_blocks_in_use() -> None:
    pool = BlockPool(6, enable_events=True)
    req, blocks = cached_request_blocks(pool, "a", list(range(8)))
    pool.take_events()
    before = pool_snapshot(pool)
    assert pool.reset_prefix_cache() is False
    assert pool_snapshot(pool) == before
    pool.free_blocks(reversed(blocks))
    assert pool.get_cached_block(req.block_hashes[0], [0]) is not None
    assert pool.reset_prefix_cache() is True
    assert pool.get_cached_block(req.block_hashes[0], [0]) is None
    assert all(b.block_hash is None for b in pool.blocks)
    assert pool.take_events() == [AllBlocksCleared()]
    check_invariants(pool)


def test_caching_disabled_never_hashes() -> None:
    pool = BlockPool(6, enable_caching=False)
    req, blocks = cached_request_blocks(pool, "a", list(range(8)))
    assert all(b.block_hash is None for b in blocks)
    assert pool.get_cached_block(req.block_hashes[0], [0]) is None
    pool.free_blocks(reversed(blocks))
    assert ids(list(pool.policy))[:2] == [2, 1]
    check_invariants(pool)


def test_verify_mode_stores_prefix_nodes() -> None:
    pool = BlockPool(6, verify_hits=True)
    req = make_request("a", list(range(8)))
    blocks = pool.get_new_blocks(2)
    with pytest.raises(InvalidArgumentError, match="prefix node"):
        pool.cache_full_blocks(req, blocks, 0, 2, 4, 0)
    nodes = PrefixChains().nodes(req, 4, 2)
    pool.cache_full_blocks(req, blocks, 0, 2, 4, 0, prefix_nodes=nodes)
    assert blocks[1].prefix_node is nodes[1] and nodes[1].parent is nodes[0]
    assert nodes[1].tokens == [4, 5, 6, 7] and nodes[1].index == 1
    pool.free_blocks(reversed(blocks))
    pool.get_new_blocks(5)
    assert all(b.prefix_node is None for b in blocks)
    check_invariants(pool)


# -- bad input changes nothing ------------------------------------------------------------------

def test_oversized_and_negative_allocation() -> None:
    pool = BlockPool(5)
    pool.get_new_blocks(2)
    before = pool_snapshot(pool)
    with pytest.raises(NoFreeBlocksError, match="only 2 are free"):
        pool.get_new_blocks(3)
    with pytest.raises(InvalidArgumentError):
        pool.get_new_blocks(-1)
    with pytest.raises(InvalidArgumentError):
        pool.get_new_blocks(1.0)  # type: ignore[arg-type]
    assert pool_snapshot(pool) == before


def test_double_free_raises_and_rolls_back() -> None:
    pool = BlockPool(6)
    a = pool.get_new_blocks(3)
    pool.touch([a[0]])  # a[0] has two references
    pool.free_blocks([a[2]])
    before = pool_snapshot(pool)
    with pytest.raises(DoubleFreeError, match=f"block {a[2].block_id}"):
        pool.free_blocks([a[0], a[1], a[2]])
    assert pool_snapshot(pool) == before
    with pytest.raises(DoubleFreeError):
        pool.free_blocks([a[1], a[1]])  # the same block twice in one call
    assert pool_snapshot(pool) == before
    check_invariants(pool, {"x": [a[0], a[1]], "y": [a[0]]})


def test_caching_a_block_of_another_group_is_rejected() -> None:
    pool = BlockPool(6, num_groups=2)
    req, blocks = cached_request_blocks(pool, "a", list(range(8)), group_id=0)
    before = pool_snapshot(pool)
    with pytest.raises(InvalidGroupError, match="cached in group 0"):
        pool.cache_full_blocks(req, blocks, 0, 2, 4, 1)
    with pytest.raises(InvalidGroupError):
        pool.cache_full_blocks(req, blocks, 0, 2, 4, 2)
    with pytest.raises(InvalidGroupError):
        pool.get_cached_block(req.block_hashes[0], [-1])
    assert pool_snapshot(pool) == before


def test_cache_rejects_bad_ranges_and_free_blocks() -> None:
    pool = BlockPool(6)
    req = make_request("a", list(range(8)), 4)
    blocks = pool.get_new_blocks(2)
    before = pool_snapshot(pool)
    with pytest.raises(InvalidArgumentError):
        pool.cache_full_blocks(req, blocks, 0, 3, 4, 0)
    with pytest.raises(InvalidArgumentError):
        pool.cache_full_blocks(req, blocks, -1, 2, 4, 0)
    other = make_request("b", list(range(100, 108)), 4)
    pool.cache_full_blocks(req, blocks, 0, 1, 4, 0)
    mid = pool_snapshot(pool)
    with pytest.raises(BlockStateError, match="another hash"):
        pool.cache_full_blocks(other, blocks, 0, 2, 4, 0)
    assert pool_snapshot(pool) == mid
    pool.free_blocks([blocks[1]])
    mid = pool_snapshot(pool)
    with pytest.raises(BlockStateError, match="is free"):
        pool.cache_full_blocks(req, blocks, 1, 2, 4, 0)
    assert pool_snapshot(pool) == mid
    assert before != mid


def test_free_queue_is_the_deprecated_name_of_policy() -> None:
    pool = BlockPool(8)
    with pytest.warns(DeprecationWarning, match="BlockPool.policy"):
        assert pool.free_queue is pool.policy


def test_trusted_touch_and_free_match_the_checked_calls() -> None:
    """``trusted=True`` skips the input checks only: the same calls leave the same state (the
    managers' entry points; the double free is still refused)."""
    pools = [BlockPool(8), BlockPool(8)]
    for pool, trusted in zip(pools, (False, True)):
        _, blocks = cached_request_blocks(pool, "a", list(range(12)))
        pool.free_blocks(blocks[::-1], trusted=trusted)
        pool.touch(blocks[:2], trusted=trusted)
        pool.free_blocks(blocks[:2][::-1], trusted=trusted)
        with pytest.raises(DoubleFreeError):
            pool.free_blocks([blocks[0]], trusted=trusted)
        check_invariants(pool)
    assert pool_snapshot(pools[0]) == pool_snapshot(pools[1])
    assert ids(list(pools[0].policy)) == ids(list(pools[1].policy))
    with pytest.raises(BlockStateError):  # the checked call still checks
        pools[0].touch([pools[1].blocks[1]])


def test_move_block_hashes_repoints_every_entry_without_events() -> None:
    """vLLM's move for a running request's copy-on-write: the copy takes the source's hash, its
    partial entry's token count and its extra partial keys; the source is left unhashed."""
    pool = BlockPool(8, enable_events=True)
    req = make_request("r", list(range(12)), 4)  # hashes every 4 tokens
    src, dst = pool.get_new_blocks(2)
    pool.cache_partial_block(req, src, 4, 4, 0)  # a partial entry: src's hash
    pool.cache_partial_block(req, src, 8, 4, 0)  # longer: replaces it
    assert pool.partial_primary_tokens(src) == 8
    pool.take_events()
    before = pool.cache_version
    pool.move_block_hashes(src, dst)
    assert src.block_hash is None and pool.partial_primary_tokens(src) is None
    assert dst.block_hash == req.block_hashes[1] and pool.partial_primary_tokens(dst) == 8
    assert pool.get_cached_block(req.block_hashes[1], [0]) == [dst]
    assert pool.take_events() == []
    assert pool.cache_version != before
    pool.free_blocks([src, dst])
    check_invariants(pool)
    # dst now leaves the cache like any cached block: one BlockRemoved for its key.
    pool.evict_blocks([dst.block_id])
    assert [type(e) for e in pool.take_events()] == [BlockRemoved]
    assert pool.get_cached_block(req.block_hashes[1], [0]) is None


def test_move_block_hashes_carries_extra_keys_and_keeps_duplicates_first() -> None:
    pool = BlockPool(8)
    req = make_request("r", list(range(8)), 4)
    a, b, dst = pool.get_new_blocks(3)
    pool.cache_full_blocks(req, [a], 0, 1, 4, 0)
    pool.cache_full_blocks(req, [b], 0, 1, 4, 0)  # a duplicate of a's hash
    pool.cache_partial_block(req, a, 8, 4, 0)  # an extra key on a (a is hashed)
    assert pool.secondary_keys(a) == (req.block_hashes[1],)
    pool.move_block_hashes(a, dst)
    assert a.block_hash is None and pool.secondary_keys(a) == ()
    assert dst.block_hash == req.block_hashes[0]
    assert pool.secondary_keys(dst) == (req.block_hashes[1],)
    # b, the earlier duplicate, is promoted; dst waits behind it as vLLM's dict insert does.
    assert pool.get_cached_block(req.block_hashes[0], [0]) == [b]
    assert pool.get_cached_block(req.block_hashes[1], [0]) == [dst]
    pool.free_blocks([b])
    pool.evict_blocks([b.block_id])
    assert pool.get_cached_block(req.block_hashes[0], [0]) == [dst]
    check_invariants(pool)


def test_move_block_hashes_from_an_unhashed_block_moves_nothing() -> None:
    pool = BlockPool(4)
    src, dst = pool.get_new_blocks(2)
    before = pool_snapshot(pool)
    pool.move_block_hashes(src, dst)
    assert pool_snapshot(pool) == before


@pytest.mark.parametrize(("case", "error", "match"), [
    ("null", NullBlockError, "null block"),
    ("self", BlockStateError, "onto itself"),
    ("hashed", BlockStateError, "already cached"),
    ("foreign", BlockStateError, "not a block of this pool"),
])
def test_move_block_hashes_refusals_change_nothing(case: str, error: type[Exception],
                                                   match: str) -> None:
    pool = BlockPool(8)
    req = make_request("r", list(range(8)), 4)
    src, other = pool.get_new_blocks(2)
    pool.cache_full_blocks(req, [src, other], 0, 2, 4, 0)
    dst = {"null": pool.null_block, "self": src, "hashed": other,
           "foreign": BlockPool(8).blocks[3]}[case]
    before = pool_snapshot(pool)
    with pytest.raises(error, match=match):
        pool.move_block_hashes(src, dst)
    assert pool_snapshot(pool) == before


def test_cache_partial_block_returns_its_key_and_can_replace_every_entry() -> None:
    """vLLM's ``replace_existing_hashes``: the block's content changed (a Mamba checkpoint
    re-keyed at its boundary), so every entry it carried leaves (one ``BlockRemoved`` each)
    before the new one is stored, even one it carried already."""
    pool = BlockPool(8, enable_events=True)
    req = make_request("r", list(range(12)), 4)
    a, = pool.get_new_blocks(1)
    pool.cache_full_blocks(req, [a], 0, 1, 4, 0)  # a's hash: the first 4 tokens
    assert pool.cache_partial_block(req, a, 8, 4, 0) == req.block_hashes[1]  # an extra key
    assert pool.cache_partial_block(req, a, 8, 4, 0) == req.block_hashes[1]  # already there
    pool.take_events()
    assert pool.cache_partial_block(req, a, 12, 4, 0,
                                    replace_existing_hashes=True) == req.block_hashes[2]
    events = pool.take_events()
    assert [type(e) for e in events] == [BlockRemoved, BlockRemoved, BlockStored]
    assert a.block_hash == req.block_hashes[2] and pool.secondary_keys(a) == ()
    assert pool.partial_primary_tokens(a) == 12
    assert pool.get_cached_block(req.block_hashes[0], [0]) is None
    assert pool.get_cached_block(req.block_hashes[2], [0]) == [a]
    # Replacing with the key the block already carries stores it again.
    pool.cache_partial_block(req, a, 12, 4, 0, replace_existing_hashes=True)
    assert [type(e) for e in pool.take_events()] == [BlockRemoved, BlockStored]
    assert pool.cache_partial_block(req, pool.null_block, 4, 4, 0) is None
    with pytest.raises(InvalidArgumentError, match="replace_existing_hashes must be a bool"):
        pool.cache_partial_block(req, a, 4, 4, 0, replace_existing_hashes=1)  # type: ignore[arg-type]  # a bad input on purpose
    assert a.block_hash == req.block_hashes[2]
    pool.free_blocks([a])
    check_invariants(pool)
