"""kvcore's core behaviours that vLLM's offloading connector tests rely on (the vLLM side is
checked against vLLM itself in tests/integrations/vllm):

* ``CacheSettings.eagle_groups``: an EAGLE block drop in some groups only (vLLM's
  ``is_eagle_group``);
* ``SlidingWindowSpec.extra_retained_tokens``: a window keeps blocks below itself;
* ``KVCacheManager.set_num_free_blocks``: a pool held short of free blocks on demand.
"""

from __future__ import annotations

import pytest

from kvcore import KVCacheManager
from kvcore.errors import InvalidArgumentError, InvalidGroupError, NoFreeBlocksError
from kvcore.settings import CacheSettings
from kvcore.specs import ChunkedLocalAttentionSpec, SlidingWindowSpec
from kvcore.testing.checked import checked
from kvcore.testing.snapshot import manager_snapshot
from tests.factories import admit, full_spec, ids, make_manager, swa_spec


def _cached_prompt(m: KVCacheManager, tokens: list[int]) -> None:
    """Compute and cache ``tokens`` as one request, then free it (its blocks stay cached)."""
    r = m.make_request("first", tokens)
    assert admit(m, r) is not None
    m.free(r)


# -- eagle_groups ----------------------------------------------------------------------------

@pytest.mark.parametrize(("eagle_groups", "flags", "hit"), [
    (None, [True, True], 8),     # every group drops: 12 cached tokens, one block dropped
    ((1,), [False, True], 8),    # group 1 drops: the agreed hit drops with it
    ((0,), [True, False], 8),
    ((), [False, False], 12),    # EAGLE on, no group listed: nobody drops
])
def test_eagle_groups_pick_the_groups_whose_hits_drop(eagle_groups: tuple[int, ...] | None,
                                                      flags: list[bool], hit: int) -> None:
    # Two full-attention groups of different specs (heads), searched apart.
    m = make_manager(full_spec(4, num_kv_heads=1), full_spec(4, num_kv_heads=2), num_blocks=32,
                     use_eagle=True, eagle_groups=eagle_groups)
    assert [g.use_eagle for g in m.coordinator.managers] == flags
    _cached_prompt(m, list(range(13)))
    assert m.get_computed_blocks(m.make_request("again", list(range(13))))[1] == hit


def test_equal_specs_drop_together_as_in_vllm() -> None:
    """Groups of one spec are searched together: listing one makes both drop."""
    m = make_manager(full_spec(4), full_spec(4), swa_spec(8), num_blocks=32, use_eagle=True,
                     eagle_groups=(1,))
    assert [g.use_eagle for g in m.coordinator.managers] == [True, True, False]


def test_only_dropping_groups_cache_one_block_past_the_aligned_boundary() -> None:
    """Hybrid block sizes 4 and 8 (hits aligned to 8): after 12 computed tokens a dropping
    group caches one block past the aligned 8 (its EAGLE lookup reads it), the others stop at
    8."""
    for eagle_groups, cached in (((0,), [3, 1]), ((1,), [2, 1]), (None, [3, 1]), ((), [2, 1])):
        m = make_manager(full_spec(4), full_spec(8), num_blocks=32, use_eagle=True,
                         eagle_groups=eagle_groups)
        r = m.make_request("r", list(range(14)))
        assert m.allocate_slots(r, 12) is not None
        r.num_computed_tokens = 12
        m.cache_blocks(r, 12)
        assert [g.num_cached_block["r"] for g in m.coordinator.managers] == cached, eagle_groups


def test_sliding_window_replay_boundaries_follow_any_dropping_group() -> None:
    """With sparse retention a window caches the tails a replaying request resumes at; those
    boundaries are EAGLE's (one aligned block lower) when any group drops, even if the window
    itself does not (vLLM computes them once for all groups)."""
    from kvcore.specs import KVCacheConfig, KVCacheGroup

    def cached_blocks(eagle_groups: tuple[int, ...] | None) -> list[int]:
        config = KVCacheConfig(64, (KVCacheGroup(("a",), full_spec(4)),
                                    KVCacheGroup(("b",), swa_spec(4))), 0)
        m = KVCacheManager(config, 256, use_eagle=eagle_groups is not None,
                           eagle_groups=eagle_groups)
        r = m.make_request("r", list(range(25)))
        admit(m, r)
        swa = m.coordinator.managers[1]
        return [i for i, b in enumerate(swa.req_to_blocks["r"]) if b.block_hash is not None]

    plain = cached_blocks(None)
    drop_in_full_only = cached_blocks((0,))
    assert plain != drop_in_full_only  # the boundaries moved with the other group's drop
    assert cached_blocks((0, 1)) != drop_in_full_only  # the window's own drop shifts its tail


def test_bad_eagle_groups_are_refused_naming_them() -> None:
    with pytest.raises(InvalidArgumentError, match="eagle_groups"):
        CacheSettings(use_eagle=True, eagle_groups=[0])  # type: ignore[arg-type]  # a list
    with pytest.raises(InvalidArgumentError, match="eagle_groups"):
        CacheSettings(use_eagle=True, eagle_groups=(0, 0))
    with pytest.raises(InvalidArgumentError, match="eagle_groups"):
        CacheSettings(use_eagle=True, eagle_groups=(-1,))
    with pytest.raises(InvalidGroupError, match=r"eagle_groups \[2\]"):
        make_manager(full_spec(4), swa_spec(8), use_eagle=True, eagle_groups=(0, 2))
    chunked = ChunkedLocalAttentionSpec(block_size=4, num_kv_heads=2, head_size=8,
                                        attention_chunk_size=8)
    with pytest.raises(InvalidArgumentError, match="group 1 would drop"):
        make_manager(full_spec(4), chunked, use_eagle=True, eagle_groups=(1,))
    # A chunked-local group that does not drop is fine next to one that does (as in vLLM).
    m = make_manager(full_spec(4), chunked, use_eagle=True, eagle_groups=(0,))
    assert [g.use_eagle for g in m.coordinator.managers] == [True, False]


# -- extra_retained_tokens -------------------------------------------------------------------

@pytest.mark.parametrize(("extra", "nulls"), [(0, 4), (1, 4), (2, 3), (5, 3), (6, 2)])
def test_a_window_retains_extra_tokens_below_itself(extra: int, nulls: int) -> None:
    """Window 4, blocks of 4: at 20 computed tokens the next token reads 17..19, so blocks
    0-3 (tokens 0..15) are released, fewer while ``extra`` more tokens (below 17) are kept."""
    spec = SlidingWindowSpec(block_size=4, num_kv_heads=2, head_size=8, sliding_window=4,
                             extra_retained_tokens=extra)
    m = make_manager(spec, num_blocks=32)
    r = m.make_request("r", list(range(20)))
    assert admit(m, r) is not None
    m.remove_skipped_blocks("r", 20)
    table = m.get_blocks("r")[0]
    assert [b.is_null for b in table] == [True] * nulls + [False] * (5 - nulls)
    m.check_invariants()
    # Freed later, counted in the per-request cap.
    assert spec.max_blocks_per_request(64, 8) == -(-min(3 + extra + 8, 64) // 4) + 1


def test_a_hit_need_not_cover_the_extra_retained_tokens() -> None:
    """A hit gives the window's blocks only (vLLM's search ignores the extra tokens): the
    request is admitted with nulls there and keeps what it computes from then on."""
    spec = SlidingWindowSpec(block_size=4, num_kv_heads=2, head_size=8, sliding_window=4,
                             extra_retained_tokens=5)
    m = make_manager(full_spec(4), spec, num_blocks=48)
    _cached_prompt(m, list(range(21)))
    r = m.make_request("r", list(range(21)))
    blocks, hit = m.get_computed_blocks(r)
    assert hit == 20 and [b.is_null for b in blocks[1]] == [True] * 4 + [False]
    assert m.allocate_slots(r, 1, hit, blocks) is not None
    m.check_invariants()


@pytest.mark.parametrize("bad", [-1, 1.5, True])
def test_bad_extra_retained_tokens_are_refused(bad: object) -> None:
    with pytest.raises(InvalidArgumentError, match="extra_retained_tokens"):
        SlidingWindowSpec(block_size=4, num_kv_heads=2, head_size=8, sliding_window=4,
                          extra_retained_tokens=bad)  # type: ignore[arg-type]  # the bad value
    with pytest.raises(InvalidArgumentError, match="bounded_replay"):
        SlidingWindowSpec(block_size=4, num_kv_heads=2, head_size=8, sliding_window=4,
                          bounded_replay=True, extra_retained_tokens=2)


# -- set_num_free_blocks ---------------------------------------------------------------------

def test_a_pool_held_short_refuses_allocations_and_keeps_its_cache() -> None:
    m = make_manager(full_spec(4), num_blocks=16)
    _cached_prompt(m, list(range(12)))  # blocks 1-3 cached, free
    running = m.make_request("run", list(range(50, 54)))
    assert admit(m, running) is not None
    order = ids(list(m.pool.policy))
    free = m.pool.num_free_blocks
    m.set_num_free_blocks(0)
    assert m.pool.num_free_blocks == 0 and m.num_held_free_blocks == free
    assert m.pool.usage == 1.0
    m.check_invariants()
    # Nothing can be allocated, nothing was evicted, and the prefix still hits.
    assert m.allocate_slots(m.make_request("new", [9, 9, 9]), 3) is None
    again = m.make_request("again", list(range(12)))
    assert m.get_computed_blocks(again)[1] == 8
    # Giving the held blocks back restores the free side as it was, in the same order.
    m.set_num_free_blocks(free)
    assert m.num_held_free_blocks == 0 and ids(list(m.pool.policy)) == order
    m.check_invariants()
    # A block freed while others are held is free as usual (the count rises).
    m.set_num_free_blocks(0)
    assert not m.reset_prefix_cache()  # held blocks count as in use
    m.free(running)
    assert m.pool.num_free_blocks == 1
    m.set_num_free_blocks(free + 1)
    assert m.num_held_free_blocks == 0 and m.pool.num_free_blocks == 15
    m.check_invariants()
    assert m.reset_prefix_cache()


def test_holding_takes_the_blocks_reused_last() -> None:
    m = checked(make_manager(full_spec(4), num_blocks=16))  # invariants after every call
    _cached_prompt(m, list(range(12)))
    order = ids(list(m.pool.policy))
    m.set_num_free_blocks(5)
    assert ids(list(m.pool.policy)) == order[:5]  # allocations take what they would have
    m.set_num_free_blocks(2)
    assert ids(list(m.pool.policy)) == order[:2]
    m.set_num_free_blocks(9)  # the held blocks that were to be reused first come back first
    assert sorted(ids(list(m.pool.policy))) == sorted(order[:9])
    m.check_invariants()


def test_a_count_that_cannot_be_honoured_changes_nothing() -> None:
    m = make_manager(full_spec(4), num_blocks=16)
    _cached_prompt(m, list(range(12)))
    m.set_num_free_blocks(4)
    before = manager_snapshot(m)
    with pytest.raises(NoFreeBlocksError, match="only 4 blocks are free and 11 held back"):
        m.set_num_free_blocks(16)
    for bad in (-1, 2.0, True, None):
        with pytest.raises(InvalidArgumentError, match="num_free_blocks"):
            m.set_num_free_blocks(bad)  # type: ignore[arg-type]  # the bad value
    assert manager_snapshot(m) == before
