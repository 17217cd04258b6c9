"""check_invariants catches a planted fault of every kind, naming the rule and the block."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import pytest

from kvcore.block_pool import BlockPool
from kvcore.errors import InvariantError
from kvcore.testing import check_invariants
from kvcore.types import BlockHash, KVCacheBlock, PrefixNode
from kvcore.verify import PrefixChains
from tests.factories import PoolOptions, make_request

if TYPE_CHECKING:
    from typing_extensions import Unpack


def populated_pool(**kwargs: Unpack[PoolOptions]) -> tuple[BlockPool, list[KVCacheBlock]]:
    """Blocks 1-3 in use by request "a" (1, 2 cached), 4-9 free, then 2 freed cached blocks of "b"."""
    pool = BlockPool(12, **kwargs)
    chains = PrefixChains()
    req = make_request("a", list(range(10)), 4)
    a = pool.get_new_blocks(3)
    pool.cache_full_blocks(req, a, 0, 2, 4, 0, prefix_nodes=chains.nodes(req, 4, 2))
    other = make_request("b", list(range(50, 58)), 4)
    b = pool.get_new_blocks(2)
    pool.cache_full_blocks(other, b, 0, 2, 4, 0, prefix_nodes=chains.nodes(other, 4, 2))
    pool.free_blocks(reversed(b))
    check_invariants(pool, {"a": [a]})
    return pool, a


def expect(rule: str, fault: Callable[[BlockPool, list[KVCacheBlock]], object],
           block_id: int | None = None, owners: bool = False,
           **kwargs: Unpack[PoolOptions]) -> InvariantError:
    pool, a = populated_pool(**kwargs)
    fault(pool, a)
    with pytest.raises(InvariantError) as info:
        check_invariants(pool, {"a": [a]} if owners else None)
    err = info.value
    assert err.rule == rule, str(err)
    assert f"[{rule}]" in str(err)
    if block_id is not None:
        assert err.block_id == block_id, str(err)
    return err


def queue_ids(pool: BlockPool) -> list[KVCacheBlock]:
    return list(pool.policy)


def test_clean_pool_passes() -> None:
    pool, a = populated_pool()
    check_invariants(pool, {"a": [a]})
    check_invariants(pool, {"a": a})  # a flat list is accepted too


def test_corrupt_prev_link() -> None:
    def fault(pool: BlockPool, a: list[KVCacheBlock]) -> None:
        q = queue_ids(pool)
        q[2].prev_free = q[0]
    err = expect("queue-links", fault)
    assert "prev_free" in str(err)


def test_broken_chain() -> None:
    def fault(pool: BlockPool, a: list[KVCacheBlock]) -> None:
        queue_ids(pool)[3].next_free = None
    expect("queue-links", fault)


def test_tail_sentinel_mismatch() -> None:
    def fault(pool: BlockPool, a: list[KVCacheBlock]) -> None:
        pool.policy.tail.prev_free = queue_ids(pool)[0]
    expect("queue-links", fault)


@pytest.mark.parametrize("back", [0, 2, 5])
def test_cycle_in_queue_is_caught_and_walk_terminates(back: int) -> None:
    def fault(pool: BlockPool, a: list[KVCacheBlock]) -> None:
        q = queue_ids(pool)
        q[-1].next_free = q[back]
        q[back].prev_free = q[-1]
    expect("queue-links", fault)


def test_foreign_block_in_queue() -> None:
    def fault(pool: BlockPool, a: list[KVCacheBlock]) -> None:
        q = queue_ids(pool)
        stranger = KVCacheBlock(5)
        stranger.prev_free, stranger.next_free = q[0], q[2]
        q[0].next_free = stranger
        q[2].prev_free = stranger
    expect("queue-foreign", fault, block_id=5)


def test_length_counter_drift() -> None:
    def fault(pool: BlockPool, a: list[KVCacheBlock]) -> None:
        pool.policy._num_free += 1
    err = expect("queue-length", fault)
    assert err.observed == (9, 8)


def test_queued_block_with_references() -> None:
    def fault(pool: BlockPool, a: list[KVCacheBlock]) -> None:
        queue_ids(pool)[1].ref_cnt = 1  # queue: 6..11, then the freed cached blocks 5, 4
    expect("block-state", fault, block_id=7)


def test_leaked_block() -> None:
    def fault(pool: BlockPool, a: list[KVCacheBlock]) -> None:
        a[2].ref_cnt = 0  # not queued, not referenced: lost
    err = expect("block-state", fault, block_id=3)
    assert "leaked" in str(err)


def test_dangling_links_on_unqueued_block() -> None:
    def fault(pool: BlockPool, a: list[KVCacheBlock]) -> None:
        a[0].next_free = queue_ids(pool)[0]
    expect("block-state", fault, block_id=1)


def test_ref_count_off_by_one_against_owners() -> None:
    def fault(pool: BlockPool, a: list[KVCacheBlock]) -> None:
        a[1].ref_cnt += 1
    err = expect("ref-count", fault, block_id=2, owners=True)
    assert err.observed == (2, 1)


def test_owner_holding_foreign_block() -> None:
    pool, a = populated_pool()
    with pytest.raises(InvariantError) as info:
        check_invariants(pool, {"a": [[*a, KVCacheBlock(3)]]})
    assert info.value.rule == "ref-count"


def test_map_entry_with_wrong_hash() -> None:
    def fault(pool: BlockPool, a: list[KVCacheBlock]) -> None:
        a[0].block_hash = BlockHash(b"\x00" * 16)
    expect("map-entry", fault, block_id=1)


def test_map_entry_with_wrong_group() -> None:
    def fault(pool: BlockPool, a: list[KVCacheBlock]) -> None:
        a[0].group_id = 1
    expect("map-entry", fault, block_id=1, num_groups=2)


def test_hashed_block_missing_from_map() -> None:
    def fault(pool: BlockPool, a: list[KVCacheBlock]) -> None:
        a[2].block_hash = BlockHash(b"\x07" * 16)
        a[2].group_id = 0
    expect("hashed-unmapped", fault, block_id=3)


def test_map_entry_removed_behind_the_blocks_back() -> None:
    def fault(pool: BlockPool, a: list[KVCacheBlock]) -> None:
        h = a[1].block_hash
        del pool._maps.cached[0][h]  # type: ignore[index]
    expect("hashed-unmapped", fault, block_id=2)


def test_unhashed_block_naming_a_group() -> None:
    def fault(pool: BlockPool, a: list[KVCacheBlock]) -> None:
        a[2].group_id = 0
    expect("map-entry", fault, block_id=3)


def test_null_block_in_queue() -> None:
    def fault(pool: BlockPool, a: list[KVCacheBlock]) -> None:
        null = pool.null_block
        first = queue_ids(pool)[0]
        KVCacheBlock.next_free.__set__(null, first)  # type: ignore[attr-defined]
    expect("null-block", fault, block_id=0)


def test_null_block_hashed() -> None:
    def fault(pool: BlockPool, a: list[KVCacheBlock]) -> None:
        pool.null_block.block_hash = BlockHash(b"\x01" * 16)
    expect("null-block", fault, block_id=0)


def test_null_block_in_map() -> None:
    def fault(pool: BlockPool, a: list[KVCacheBlock]) -> None:
        pool._maps.cached[0][BlockHash(b"\x09" * 16)] = pool.null_block
    expect("null-block", fault, block_id=0)


def test_block_ids_out_of_place() -> None:
    def fault(pool: BlockPool, a: list[KVCacheBlock]) -> None:
        pool.blocks[4], pool.blocks[5] = pool.blocks[5], pool.blocks[4]
    expect("block-id", fault, block_id=5)


def test_hash_with_caching_disabled() -> None:
    pool = BlockPool(6, enable_caching=False)
    (b,) = pool.get_new_blocks(1)
    b.block_hash = BlockHash(b"\x02" * 16)
    with pytest.raises(InvariantError) as info:
        check_invariants(pool)
    assert info.value.rule == "caching-off" and info.value.block_id == 1


def test_prefix_node_rules() -> None:
    def stray(pool: BlockPool, a: list[KVCacheBlock]) -> None:
        a[2].prefix_node = PrefixNode(None, 0, [1, 2, 3, 4], None)
    expect("prefix-node", stray, block_id=3)

    def missing(pool: BlockPool, a: list[KVCacheBlock]) -> None:
        a[0].prefix_node = None
    expect("prefix-node", missing, block_id=1, verify_hits=True)
