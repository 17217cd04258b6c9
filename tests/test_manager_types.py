"""Attention types behind the manager: sliding window, chunked local, Mamba, cross attention, and
hybrid combinations (block size 4 unless stated)."""

from __future__ import annotations

from collections.abc import Iterable

import pytest
import torch

from kvcore.coordinator import HybridCoordinator, NoPrefixCacheCoordinator, UnitaryCoordinator
from kvcore.specs import ChunkedLocalAttentionSpec, CrossAttentionSpec, MambaSpec
from kvcore.types import KVCacheBlock
from tests.factories import admit, decode, full_spec, make_manager, manager_snapshot, swa_spec

BS = 4


def ids(blocks: Iterable[KVCacheBlock]) -> list[int]:
    return [b.block_id for b in blocks]


def chunked_spec(chunk: int) -> ChunkedLocalAttentionSpec:
    return ChunkedLocalAttentionSpec(block_size=BS, num_kv_heads=2, head_size=8,
                                     dtype=torch.float16, attention_chunk_size=chunk)


def mamba_spec() -> MambaSpec:
    return MambaSpec(block_size=BS, shapes=((4, 8), (8, 16)), dtypes=(torch.float32, torch.float32))


def cross_spec() -> CrossAttentionSpec:
    return CrossAttentionSpec(block_size=BS, num_kv_heads=2, head_size=8, dtype=torch.float16)


mgr = make_manager


# -- sliding window -------------------------------------------------------------------------------

def test_sliding_window_frees_blocks_that_left_the_window() -> None:
    m = mgr(swa_spec(8), num_blocks=16)
    a = m.make_request("a", range(20))
    admit(m, a)
    assert m.get_block_ids("a") == ([1, 2, 3, 4, 5],)
    free_before = m.num_free_blocks
    decode(m, a, 99)  # 20 computed: tokens 0..12 are outside the window of token 20
    assert m.get_block_ids("a") == ([0, 0, 0, 4, 5, 6],)
    assert m.num_free_blocks == free_before + 3 - 1
    # The released blocks are cached, so they go to the tail, newest released first.
    assert ids(m.pool.policy)[-3:] == [3, 2, 1]
    m.check_invariants()


def test_sliding_window_hit_is_right_most_contiguous_window() -> None:
    m = mgr(swa_spec(8), num_blocks=16)
    a = m.make_request("a", range(20))
    admit(m, a)
    decode(m, a, 99)
    b = m.make_request("b", [*range(16), 70, 71, 72, 73])
    blocks, hit = m.get_computed_blocks(b)
    # Window 8 needs cdiv(7, 4) = 2 blocks; the right-most cached run of 2 ending by token 16.
    assert hit == 16 and ids(blocks[0]) == [0, 0, 3, 4]
    out = m.allocate_slots(b, 4, hit, blocks)
    assert out is not None
    assert m.get_block_ids("b") == ([0, 0, 3, 4, 7],)
    assert m.pool.blocks[3].ref_cnt == 1 and m.pool.blocks[4].ref_cnt == 2
    m.check_invariants()


def test_sliding_window_short_hit_at_start_only() -> None:
    m = mgr(swa_spec(16), num_blocks=16)  # needs 4 contiguous blocks
    a = m.make_request("a", range(9))
    admit(m, a)
    b = m.make_request("b", [*range(8), 5, 5, 5, 5, 5])
    blocks, hit = m.get_computed_blocks(b)
    assert hit == 8 and ids(blocks[0]) == [1, 2]  # no full window anywhere: prefix run only


def test_sliding_window_evictable_hits_count_towards_capacity() -> None:
    m = mgr(swa_spec(8), num_blocks=8)  # 7 usable
    a = m.make_request("a", range(16))
    admit(m, a)
    m.free(a)
    b = m.make_request("b", [*range(16), 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12])
    blocks, hit = m.get_computed_blocks(b)
    assert hit == 16 and ids(blocks[0]) == [0, 0, 3, 4]
    # 7 blocks in all (2 skipped nulls): 2 evictable hits + 3 new = 5 <= 7 free.
    assert m.allocate_slots(b, 12, hit, blocks) is not None
    m.check_invariants()


def test_failed_swa_allocation_keeps_out_of_window_blocks() -> None:
    m = mgr(swa_spec(4), num_blocks=6)  # 5 usable
    a = m.make_request("a", range(12))
    admit(m, a)
    hog = m.make_request("hog", range(100, 108))
    admit(m, hog)
    a.append_output_token_ids(list(range(50, 62)))
    before = manager_snapshot(m)
    # Growing to 24 slots needs 3 more blocks; releasing 2 out-of-window ones is not enough.
    assert m.allocate_slots(a, 12) is None
    assert manager_snapshot(m) == before  # vLLM would already have released them
    m.remove_skipped_blocks("a", 12)
    assert m.get_block_ids("a") == ([0, 0, 3],)
    m.check_invariants()


# -- chunked local ------------------------------------------------------------------------------

def test_chunked_local_nulls_before_current_chunk() -> None:
    m = mgr(chunked_spec(8), num_blocks=16)
    a = m.make_request("a", range(20))
    blocks, hit = m.get_computed_blocks(a)
    # Max hit 19 tokens: the last token's chunk starts at 16, so no layer ever reads tokens
    # 0-15 for this request: they count as computed and hold the null block.
    assert hit == 16 and ids(blocks[0]) == [0, 0, 0, 0]
    assert m.allocate_slots(a, 4, hit, blocks) is not None
    a.num_computed_tokens = 20
    assert m.get_block_ids("a") == ([0, 0, 0, 0, 1],)
    c = m.make_request("c", range(24))
    blocks, hit = m.get_computed_blocks(c)  # chunk 16-23: block 4 (tokens 16-19) is cached
    assert hit == 20 and ids(blocks[0]) == [0, 0, 0, 0, 1]
    for t in range(4):
        decode(m, a, t)
    assert m.get_block_ids("a") == ([0, 0, 0, 0, 1, 2],)
    decode(m, a, 9)  # 24 computed: chunk 16-23 is done, its blocks are released
    assert m.get_block_ids("a") == ([0, 0, 0, 0, 0, 0, 3],)
    m.check_invariants()


# -- mamba ----------------------------------------------------------------------------------------

def test_mamba_keeps_only_latest_state_and_hits_last_block() -> None:
    m = mgr(mamba_spec(), num_blocks=16)
    a = m.make_request("a", range(16))
    admit(m, a)
    b = m.make_request("b", [*range(16), 9, 9, 9, 9])
    blocks, hit = m.get_computed_blocks(b)
    assert hit == 16 and ids(blocks[0]) == [0, 0, 0, 4]
    # Block 4's state is cached this very step: it cannot be used yet.
    assert m.allocate_slots(b, 4, hit, blocks) is None
    m.new_step()
    assert m.allocate_slots(b, 4, hit, blocks) is not None
    assert m.get_block_ids("b") == ([0, 0, 0, 4, 5],)
    decode(m, a, 7)  # a's older states (blocks 1-3) are released
    assert m.get_block_ids("a") == ([0, 0, 0, 4, 6],)
    m.check_invariants()


def mamba_align_spec(checkpoint: bool = False) -> MambaSpec:
    return MambaSpec(block_size=BS, shapes=((2, 4),), dtypes=(torch.float32,),
                     mamba_cache_mode="align", num_prefill_checkpoint_blocks=int(checkpoint),
                     prefill_checkpoint_alignment=1 if checkpoint else None)


def test_mamba_align_holds_the_running_state_its_source_and_the_prompt_checkpoint() -> None:
    """Dense retention (no interval): every chunk that can export a checkpoint does."""
    m = mgr(full_spec(BS), mamba_align_spec(checkpoint=True), num_blocks=24)
    a = m.make_request("a", range(14))
    # A chunk of two blocks: the checkpoint for the state at 4 (index 0) and the running state.
    out = m.allocate_slots(a, 8)
    assert out is not None and out.get_block_ids() == ([1, 2], [3, 4])
    a.num_computed_tokens = 8
    # The prompt's last chunk: the state at 4 is no longer needed (released, still cached), the
    # checkpoint for the prompt's last boundary (12, index 2) and the new running state; the
    # state the kernel copies from (index 1) stays until this step is processed.
    out = m.allocate_slots(a, 6)
    assert out is not None and out.get_block_ids() == ([5, 6], [7, 8])
    assert m.get_block_ids("a") == ([1, 2, 5, 6], [0, 4, 7, 8])
    a.num_computed_tokens = 14
    m.new_step()
    b = m.make_request("b", [*range(12), 7, 7])
    blocks, hit = m.get_computed_blocks(b)
    assert hit == 12 and ids(blocks[1]) == [0, 0, 7]  # the checkpoint's state
    decode(m, a, 5)  # processed past both: the source and the checkpoint go back to the pool
    assert m.get_block_ids("a")[1] == [0, 0, 0, 8]
    m.check_invariants()


@pytest.mark.parametrize("use_eagle", [False, True])
def test_mamba_align_failed_allocation_changes_nothing(use_eagle: bool) -> None:
    m = mgr(full_spec(BS), mamba_align_spec(), num_blocks=4, use_eagle=use_eagle)
    a = m.make_request("a", range(16))
    before = manager_snapshot(m)
    assert m.allocate_slots(a, 16) is None  # 4 attention blocks + 1 state block > 3 free
    assert manager_snapshot(m) == before


def test_mamba_speculative_failed_growth_changes_nothing() -> None:
    """A running request whose growth fails keeps its table, speculative blocks included, and
    the next growth moves them as if the failed call never happened."""
    spec = MambaSpec(block_size=BS, shapes=((2, 4),), dtypes=(torch.float32,),
                     mamba_cache_mode="align", num_speculative_blocks=2)
    m = mgr(full_spec(BS), spec, num_blocks=12)
    a = m.make_request("a", range(30))
    assert m.allocate_slots(a, 4) is not None  # 1 + (1 running + 2 speculative) blocks
    a.num_computed_tokens = 4
    hog = m.make_request("hog", range(12))
    assert m.allocate_slots(hog, 12) is not None  # 3 + 3 more: 1 block left free
    before = manager_snapshot(m)
    assert m.allocate_slots(a, 20) is None  # needs 5 attention blocks
    assert manager_snapshot(m) == before
    m.free(hog)
    assert m.allocate_slots(a, 20) is not None
    assert len(m.get_blocks("a")[1]) == 6 + 2
    m.check_invariants()


# -- cross attention ------------------------------------------------------------------------------

def test_cross_attention_allocated_once_never_cached() -> None:
    m = mgr(full_spec(BS), cross_spec(), num_blocks=16, enable_events=True)
    r = m.make_request("a", range(6))
    out = m.allocate_slots(r, 6, num_encoder_tokens=10)
    assert out is not None and out.get_block_ids() == ([1, 2], [3, 4, 5])
    r.num_computed_tokens = 6
    decode(m, r, 1)
    decode(m, r, 2)
    assert m.get_block_ids("a") == ([1, 2], [3, 4, 5])
    assert all(m.pool.blocks[i].block_hash is None for i in (3, 4, 5))
    m.free(r)
    b = m.make_request("b", range(6))
    blocks, hit = m.get_computed_blocks(b)
    assert hit == 4 and ids(blocks[0]) == [1] and list(blocks[1]) == []
    m.check_invariants()


def test_cross_attention_grows_to_encoder_tokens_on_any_allocation() -> None:
    """As vLLM's manager: the encoder table grows whenever num_encoder_tokens asks for more
    (counted before anything is taken), and external tokens give it nothing."""
    m = mgr(full_spec(BS), cross_spec(), num_blocks=8, enable_caching=False)
    r = m.make_request("a", range(6))
    out = m.allocate_slots(r, 2, num_external_computed_tokens=4)
    assert out is not None and m.get_block_ids("a") == ([1, 2], [])
    assert m.coordinator.managers[1].num_cached_block == {}
    r.num_computed_tokens = 6
    # 5 free blocks: 2 more decoder slots fit in the decoder's blocks, 40 encoder tokens
    # (10 blocks) do not.
    before = manager_snapshot(m)
    assert m.allocate_slots(r, 2, num_encoder_tokens=40) is None
    assert manager_snapshot(m) == before
    out = m.allocate_slots(r, 1, num_encoder_tokens=10)
    assert out is not None and out.get_block_ids() == ([], [3, 4, 5])
    assert m.allocate_slots(r, 1, num_encoder_tokens=4) is not None  # never shrinks
    assert m.get_block_ids("a") == ([1, 2], [3, 4, 5])
    m.check_invariants()


# -- hybrid ---------------------------------------------------------------------------------------

def test_coordinator_factory() -> None:
    assert isinstance(mgr(full_spec()).coordinator, UnitaryCoordinator)
    assert isinstance(mgr(full_spec(), swa_spec(8)).coordinator, HybridCoordinator)
    assert isinstance(mgr(full_spec(), swa_spec(8), enable_caching=False).coordinator,
                      NoPrefixCacheCoordinator)


def test_hybrid_hit_limited_by_the_stricter_group() -> None:
    m = mgr(full_spec(BS), swa_spec(8), num_blocks=32)
    a = m.make_request("a", range(16))
    admit(m, a)
    m.free(a)
    b = m.make_request("b", [*range(16), 1, 2, 3, 4])
    # Both groups cached 4 blocks; drop the sliding group's last one.
    m.evict_blocks([m.pool.get_cached_block(b.block_hashes[3], [1])[0].block_id])  # type: ignore[index]
    blocks, hit = m.get_computed_blocks(b)
    assert hit == 12
    assert len(blocks[0]) == 3 and all(not x.is_null for x in blocks[0])
    assert blocks[1][0].is_null and len(blocks[1]) == 3
    assert m.allocate_slots(b, 8, hit, blocks) is not None
    m.check_invariants()


def test_hybrid_equal_specs_are_searched_together() -> None:
    m = mgr(full_spec(BS), full_spec(BS), swa_spec(8), num_blocks=40)
    a = m.make_request("a", range(16))
    admit(m, a)
    b = m.make_request("b", [*range(16), 1])
    # Evict group 1's third block: the two full groups must agree, so the hit stops at 8.
    m.evict_blocks([m.get_block_ids("a")[1][2]])
    blocks, hit = m.get_computed_blocks(b)
    assert hit == 8 and [len(x) for x in blocks] == [2, 2, 2]
    m.check_invariants()


def test_hybrid_different_block_sizes_align_to_lcm() -> None:
    m = mgr(full_spec(4), swa_spec(16, block_size=8), num_blocks=40)
    assert m.hash_block_size == 4 and m.coordinator.alignment_tokens == 8
    a = m.make_request("a", range(22))
    admit(m, a)
    # Only lcm-aligned prefixes are cached: 16 tokens -> 4 full blocks + 2 sliding blocks.
    full_blocks, swa_blocks = m.get_blocks("a")
    assert sum(b.block_hash is not None for b in full_blocks) == 4
    assert sum(b.block_hash is not None for b in swa_blocks) == 2
    b = m.make_request("b", [*range(20), 7, 7, 7])
    blocks, hit = m.get_computed_blocks(b)
    assert hit == 16 and len(blocks[0]) == 4 and ids(blocks[1]) == ids(swa_blocks[:2])
    m.check_invariants()


def test_hybrid_sliding_cache_mask_keeps_only_reachable_blocks() -> None:
    # Window 4 needs 1 block of 4; hits land on multiples of 8, so only odd blocks are reachable.
    m = mgr(full_spec(8), swa_spec(4, block_size=4), num_blocks=40)
    a = m.make_request("a", range(24))
    admit(m, a)
    swa = m.get_blocks("a")[1]
    assert [b.block_hash is not None for b in swa] == [False, True, False, True, False, True]
    b = m.make_request("b", [*range(24), 3])
    blocks, hit = m.get_computed_blocks(b)
    assert hit == 24 and ids(blocks[1]) == [0, 0, 0, 0, 0, swa[5].block_id]
    m.check_invariants()


def test_full_plus_mamba_hybrid() -> None:
    m = mgr(full_spec(BS), mamba_spec(), num_blocks=40)
    a = m.make_request("a", range(16))
    admit(m, a)
    m.new_step()
    b = m.make_request("b", [*range(12), 8, 8, 8, 8])
    blocks, hit = m.get_computed_blocks(b)
    assert hit == 12 and len(blocks[0]) == 3 and ids(blocks[1])[:2] == [0, 0]
    assert m.allocate_slots(b, 4, hit, blocks) is not None
    m.check_invariants()
