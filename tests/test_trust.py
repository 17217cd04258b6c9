"""Regression tests for the trust issue: each case produced wrong KV, silently corrupted state or
left a partial change before it was fixed.  The random and hostile sequences around them live
in test_manager_stateful.py (hypothesis) and test_fuzz.py (seeded)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from kvcore import ChunkedLocalAttentionSpec, KVCacheConfig, KVCacheGroup, KVCacheManager, Request
from kvcore.block_pool import BlockPool
from kvcore.errors import (
    BlockStateError,
    InvalidArgumentError,
    InvalidHitError,
    InvariantError,
    RequestStateError,
    StaleHitError,
    UnknownRequestError,
)
from kvcore.specs import KVCacheSpec
from kvcore.testing import CollidingHasher, ContentOracle
from kvcore.types import KVCacheBlocks
from tests.factories import (
    full_spec,
    make_manager,
    manager_snapshot,
    pool_snapshot,
    swa_spec,
)


def chunked_spec(chunk: int, block_size: int = 4) -> ChunkedLocalAttentionSpec:
    return ChunkedLocalAttentionSpec(block_size=block_size, num_kv_heads=2, head_size=8,
                                     dtype=torch.float16, attention_chunk_size=chunk)


def run_whole_prompt(m: KVCacheManager, req: Request, oracle: ContentOracle | None = None) -> None:
    blocks, hit = m.get_computed_blocks(req)
    assert m.allocate_slots(req, req.num_tokens - hit, hit, blocks) is not None
    if oracle is not None:
        oracle.written(req, hit, req.num_tokens)
    req.num_computed_tokens = req.num_tokens


# -- 1. chunked local attention with a chunk size that is not a multiple of the block size ----

@pytest.mark.parametrize("specs", [(full_spec(4), chunked_spec(13)), (chunked_spec(13),)],
                         ids=["hybrid full+chunked", "chunked"])
def test_chunked_hit_never_leaves_its_chunk_in_null_blocks(specs: tuple[KVCacheSpec, ...]) -> None:
    m = make_manager(*specs, num_blocks=48)
    oracle = ContentOracle(m)
    prompt = list(range(100, 131))  # 31 tokens: a hit may cover 30, whose chunk starts at 26
    a = m.make_request("a", prompt)
    run_whole_prompt(m, a, oracle)
    m.free(a)
    g = len(specs) - 1  # the chunked group
    # Evict the block holding the chunk start (block 6: tokens 24..27) from the chunked group.
    m.evict_blocks([m.pool.get_cached_block(a.block_hashes[6], [g])[0].block_id])  # type: ignore[index]
    b = m.make_request("b", prompt)
    blocks, hit = m.get_computed_blocks(b)
    # Token 24 belongs to the chunk [13, 26): its blocks 3, 4, 5 must be real cached blocks.
    assert hit == 24
    assert all(not blk.is_null for blk in blocks[g][3:6])
    oracle.check_hit(b, blocks, hit)
    assert m.allocate_slots(b, b.num_tokens - hit, hit, blocks) is not None
    m.check_invariants()


def test_chunked_hit_on_a_chunk_boundary_needs_no_blocks() -> None:
    m = make_manager(chunked_spec(12), num_blocks=32)
    b = m.make_request("b", list(range(29)))  # nothing cached: 24 = 2 chunks need no KV at all
    blocks, hit = m.get_computed_blocks(b)
    assert hit == 24 and all(blk.is_null for blk in blocks[0])


# -- 2. verify_hits proves the whole chain, not only the block's tokens -----------------------

def test_verify_rejects_equal_tokens_after_another_prefix() -> None:
    # The window needs only the last block: a hash that ignores the parent makes B's last block
    # collide with A's, whose tokens are equal but whose prefix is not.
    m = make_manager(swa_spec(4, 4), num_blocks=32, verify_hits=True,
                     block_hasher=CollidingHasher("tokens"))
    oracle = ContentOracle(m)
    a = m.make_request("a", [1, 1, 1, 1, 7, 7, 7, 7, 0])
    run_whole_prompt(m, a, oracle)
    m.free(a)
    b = m.make_request("b", [2, 2, 2, 2, 7, 7, 7, 7, 0])
    blocks, hit = m.get_computed_blocks(b)
    assert hit == 0 and m.pool.num_rejected_hits >= 1
    # Genuine hits still pass.
    c = m.make_request("c", [1, 1, 1, 1, 7, 7, 7, 7, 0])
    blocks, hit = m.get_computed_blocks(c)
    assert hit == 8
    oracle.check_hit(c, blocks, hit)


def test_verify_rejects_equal_tokens_at_another_position() -> None:
    m = make_manager(full_spec(4), num_blocks=32, verify_hits=True,
                     block_hasher=CollidingHasher("tokens"))
    a = m.make_request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    run_whole_prompt(m, a)
    m.free(a)
    b = m.make_request("b", [5, 6, 7, 8, 0])  # A's second block, at position 0
    assert m.get_computed_blocks(b)[1] == 0


def test_verify_rejects_a_hit_whose_block_was_recached_for_another_prefix() -> None:
    # Between lookup and allocation, the hit block is evicted and cached again under the same
    # (colliding) hash for other tokens: allocate_slots must notice.
    m = make_manager(full_spec(4), num_blocks=8, verify_hits=True,
                     block_hasher=CollidingHasher("constant"))
    a = m.make_request("a", [1, 2, 3, 4, 9])
    run_whole_prompt(m, a)
    m.free(a)
    b = m.make_request("b", [1, 2, 3, 4, 8])
    blocks, hit = m.get_computed_blocks(b)
    assert hit == 4
    (block,) = blocks[0]
    m.evict_blocks([block.block_id])
    c = m.make_request("c", [5] * 28)  # takes all 7 usable blocks, the evicted one included
    run_whole_prompt(m, c)
    assert block.block_hash == b.block_hashes[0]  # cached again, under the same hash
    before = manager_snapshot(m)
    with pytest.raises(InvalidHitError, match="another prefix"):
        m.allocate_slots(b, 1, hit, blocks)
    assert manager_snapshot(m) == before


# -- 3. allocate_slots refuses calls that cannot be right ----------------------------------------

@pytest.fixture
def m() -> KVCacheManager:
    return make_manager(full_spec(4), num_blocks=16)


def admitted(m: KVCacheManager, rid: str, tokens: list[int]) -> Request:
    r = m.make_request(rid, tokens)
    run_whole_prompt(m, r)
    return r


def refused(m: KVCacheManager, error: type[Exception], match: str,
            call: Callable[[], object]) -> None:
    before = manager_snapshot(m)
    with pytest.raises(error, match=match):
        call()
    assert manager_snapshot(m) == before


def test_freed_request_cannot_allocate(m: KVCacheManager) -> None:
    r = admitted(m, "a", list(range(10)))
    m.free(r)
    refused(m, RequestStateError, "holds no blocks", lambda: m.allocate_slots(r, 1))
    r.append_output_token_ids(3)
    refused(m, RequestStateError, "num_computed_tokens=10", lambda: m.allocate_slots(r, 1))


def test_claimed_hits_need_their_blocks(m: KVCacheManager) -> None:
    a = admitted(m, "a", list(range(12)))
    m.free(a)
    b = m.make_request("b", list(range(12)))
    blocks, hit = m.get_computed_blocks(b)
    assert hit == 8
    refused(m, InvalidHitError, "num_new_computed_tokens=8",
            lambda: m.allocate_slots(b, 4, 8, None))
    refused(m, InvalidHitError, "num_new_computed_tokens=8",
            lambda: m.allocate_slots(b, 4, 8, KVCacheBlocks([blocks[0][:1]])))
    refused(m, InvalidHitError, "num_new_computed_tokens=4",
            lambda: m.allocate_slots(b, 8, 4, blocks))
    refused(m, InvalidHitError, "exceed", lambda: m.allocate_slots(b, 1, 16, blocks))
    refused(m, InvalidHitError, "null", lambda: m.allocate_slots(
        b, 4, 8, KVCacheBlocks([[m.pool.null_block, blocks[0][1]]])))
    refused(m, InvalidHitError, "reused for one since get_computed_blocks", lambda: m.allocate_slots(
        b, 4, 8, KVCacheBlocks([list(reversed(blocks[0]))])))


def test_hits_from_another_pool_are_refused(m: KVCacheManager) -> None:
    other = make_manager(full_spec(4), num_blocks=16)
    a = admitted(other, "a", list(range(12)))
    other.free(a)
    b = other.make_request("b", list(range(12)))
    blocks, hit = other.get_computed_blocks(b)
    assert hit == 8
    mine = m.make_request("b", list(range(12)))
    refused(m, InvalidHitError, "not a block of this manager's pool",
            lambda: m.allocate_slots(mine, 4, hit, blocks))


def test_hit_evicted_and_reused_since_lookup_is_refused_as_stale(m: KVCacheManager) -> None:
    """A scheduler looks a request up, lets other allocations evict its hit, then allocates
    with it: the error says the hit went stale between lookup and allocation (the likely
    cause), whether the block is cached for another prefix now or not cached at all."""
    a = admitted(m, "a", list(range(12)))
    m.free(a)
    b = m.make_request("b", list(range(12)))
    blocks, hit = m.get_computed_blocks(b)
    c = m.make_request("c", list(range(50, 62)))
    m.get_computed_blocks(c)  # another lookup in between: b's is not the latest
    hog = admitted(m, "hog", list(range(100, 160)))  # every free block, the cached ones too
    refused(m, StaleHitError, r"block \d+ is cached for a different prefix now: the hit went "
            "stale between lookup and allocation", lambda: m.allocate_slots(b, 4, hit, blocks))
    assert issubclass(StaleHitError, InvalidHitError)
    m.free(hog)
    blocks, hit = m.get_computed_blocks(b)
    assert hit == 0  # the prefix is gone
    a = admitted(m, "a2", list(range(12)))
    m.free(a)
    blocks, hit = m.get_computed_blocks(b)
    assert hit == 8
    m.evict_blocks([blocks[0][1].block_id])
    refused(m, StaleHitError, r"block \d+ is no longer cached: the hit went stale",
            lambda: m.allocate_slots(b, 4, hit, blocks))
    m.reset_prefix_cache()
    refused(m, StaleHitError, "went stale", lambda: m.allocate_slots(b, 4, hit, blocks))


def test_a_hit_passed_for_another_request_is_not_called_stale(m: KVCacheManager) -> None:
    a = admitted(m, "a", list(range(12)))
    m.free(a)
    b = m.make_request("b", list(range(12)))
    blocks, hit = m.get_computed_blocks(b)
    admitted(m, "hog", list(range(100, 160)))
    other = m.make_request("other", list(range(12)))  # b's tokens, but not b's lookup
    with pytest.raises(InvalidHitError) as info:
        m.allocate_slots(other, 4, hit, blocks)
    assert not isinstance(info.value, StaleHitError) and "stale" not in str(info.value)


def test_second_live_request_with_same_id(m: KVCacheManager) -> None:
    a = admitted(m, "a", list(range(10)))
    twin = m.make_request("a", list(range(20, 30)))
    refused(m, RequestStateError, "another live request", lambda: m.allocate_slots(twin, 10))
    refused(m, RequestStateError, "another request object", lambda: m.free(twin))
    m.free(a)


def test_tokens_claimed_without_slots_are_refused(m: KVCacheManager) -> None:
    a = admitted(m, "a", list(range(10)))
    a.append_output_token_ids([1, 2])
    a.num_computed_tokens = 12  # the caller skipped an allocate_slots
    refused(m, RequestStateError, "slots for only 10", lambda: m.allocate_slots(a, 1))
    refused(m, RequestStateError, "slots for 10", lambda: m.cache_blocks(a, 12))


@pytest.mark.parametrize("kwargs", [
    {"num_new_tokens": True}, {"num_new_tokens": -1}, {"num_new_tokens": 2.0},
    {"num_new_tokens": 1, "num_lookahead_tokens": True},
    {"num_new_tokens": 1, "num_lookahead_tokens": None},
    {"num_new_tokens": 1, "num_external_computed_tokens": False},
    {"num_new_tokens": 1, "num_encoder_tokens": -3},
    {"num_new_tokens": 1, "num_new_computed_tokens": True},
])
def test_bools_and_negatives_are_not_counts(m: KVCacheManager, kwargs: dict[str, object]) -> None:
    running = admitted(m, "a", list(range(10)))
    fresh = m.make_request("b", list(range(5)))
    for req in (running, fresh):
        refused(m, InvalidArgumentError, "must be a non-negative int",
                lambda req=req: m.allocate_slots(req, **kwargs))  # type: ignore[misc,arg-type]


# -- 4. failed pool calls change nothing ---------------------------------------------------------

def test_touch_and_free_of_foreign_blocks_change_nothing() -> None:
    pool, other = BlockPool(8), BlockPool(8)
    mine = pool.get_new_blocks(2)
    theirs = other.get_new_blocks(1)
    befores = pool_snapshot(pool), pool_snapshot(other)
    first, other_first = pool.policy.first(), other.policy.first()
    assert first is not None and other_first is not None
    for call in (lambda: pool.touch([mine[0], theirs[0]]),
                 lambda: pool.touch([first, other_first]),
                 lambda: pool.free_blocks([mine[0], theirs[0]]),
                 lambda: pool.touch([mine[0], "not a block"])):  # type: ignore[list-item]
        with pytest.raises(BlockStateError):
            call()
        assert (pool_snapshot(pool), pool_snapshot(other)) == befores


# -- 7. smaller ------------------------------------------------------------------------------------

def test_empty_salt_and_lora_name_are_refused() -> None:
    for kwargs in ({"cache_salt": ""}, {"lora_name": ""}, {"cache_salt": 3}):
        with pytest.raises(InvalidArgumentError, match="non-empty str"):
            Request("a", [1, 2, 3], **kwargs)


def test_salts_isolate_tenants() -> None:
    m = make_manager(full_spec(4), num_blocks=16)
    a = m.make_request("a", list(range(12)), cache_salt="tenant-a")
    run_whole_prompt(m, a)
    m.free(a)
    assert m.get_computed_blocks(m.make_request("b", list(range(12)), cache_salt="tenant-b"))[1] == 0
    assert m.get_computed_blocks(m.make_request("c", list(range(12))))[1] == 0
    assert m.get_computed_blocks(m.make_request("d", list(range(12)),
                                                cache_salt="tenant-a"))[1] == 8


@pytest.mark.parametrize("build, match", [
    (lambda: KVCacheManager(None, 16), "config must be a KVCacheConfig"),  # type: ignore[arg-type]
    (lambda: make_manager(max_model_len=True), "max_model_len"),
    (lambda: make_manager(max_model_len=0), "max_model_len"),
    (lambda: make_manager(enable_caching="yes"),  # type: ignore[arg-type]  # on purpose
     "enable_caching must be a bool"),
    (lambda: make_manager(hash_algo=None), "hash_algo must be a str"),  # type: ignore[arg-type]
    (lambda: make_manager(hash_algo="md5"), "unknown hash algorithm"),
    (lambda: make_manager(max_num_batched_tokens=0), "max_num_batched_tokens"),
    (lambda: make_manager(block_hasher="xxh3"),  # type: ignore[arg-type]  # on purpose
     "block_hasher must be a BlockHasher"),
    (lambda: KVCacheConfig(16, (None,)), "KVCacheGroup"),  # type: ignore[arg-type]
    (lambda: KVCacheGroup(("l",), None), "spec"),  # type: ignore[arg-type]
    (lambda: BlockPool(8, num_groups=True), "num_groups"),
])
def test_bad_construction_is_a_typed_error(build: Callable[[], object], match: str) -> None:
    with pytest.raises(InvalidArgumentError, match=match):
        build()


def test_unknown_request_errors_name_the_request(m: KVCacheManager) -> None:
    r = m.make_request("ghost", [1, 2, 3])
    for call in (lambda: m.free(r), lambda: m.cache_blocks(r, 1), lambda: m.uncache_blocks(r, 0),
                 lambda: m.get_block_ids("ghost")):
        with pytest.raises(UnknownRequestError, match="ghost"):
            call()


def test_invariants_prove_every_cached_block_of_a_running_request_in_verify_mode() -> None:
    m = make_manager(full_spec(4), num_blocks=16, verify_hits=True)
    a = m.make_request("a", list(range(12)))
    run_whole_prompt(m, a)
    m.check_invariants()
    block = m.get_blocks("a")[0][1]
    other = m.make_request("x", [9] * 12)
    from kvcore.verify import PrefixChains

    block.prefix_node = PrefixChains().nodes(other, 4, 2)[1]  # another prefix's provenance
    with pytest.raises(InvariantError) as info:
        m.check_invariants()
    assert info.value.rule == "prefix-node" and info.value.block_id == block.block_id


def test_unitary_verify_mode_forgets_a_freed_requests_chain() -> None:
    m = make_manager(full_spec(4), num_blocks=16, verify_hits=True)
    a = m.make_request("a", list(range(12)))
    run_whole_prompt(m, a)
    m.free(a)
    assert m.coordinator.prefix_chains is not None
    assert m.coordinator.prefix_chains.request_ids() == []
    m.check_invariants()


def test_a_verified_chain_must_reach_position_zero() -> None:
    from kvcore.types import PrefixNode
    from kvcore.verify import HitVerifier

    r = Request("r", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    first = PrefixNode(None, 0, [1, 2, 3, 4], None)
    good = PrefixNode(first, 1, [5, 6, 7, 8], None)
    assert HitVerifier(r).matches(good, 1, 4)
    orphan = PrefixNode(None, 1, [5, 6, 7, 8], None)  # right tokens, but no prefix before them
    skipping = PrefixNode(PrefixNode(None, 0, [1, 2, 3, 4], None), 2, [9, 0, 0, 0], None)
    verifier = HitVerifier(r)
    assert not verifier.matches(orphan, 1, 4)
    assert not verifier.matches(skipping, 2, 4)
    assert not verifier.matches(PrefixNode(first, 1, [5, 6, 7, 9], None), 1, 4)
