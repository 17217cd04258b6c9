"""The block-pool names a connector that binds vLLM's pool calls (vLLM's
``SimpleCPUOffloadConnector``: ``blocks[id]``, ``touch``, ``free_blocks``,
``free_block_queue.iter_blocks_after``, ``get_cached_block``, ``cached_block_hashes_by_block``
and each block's ``block_id`` / ``ref_cnt`` / ``block_hash`` / ``is_null`` /
``block_hash_num_tokens``, the pool's ``cached_block_hashes_by_block``), against vLLM's own ``BlockPool`` call for call after the same
manager calls, kvcore's invariants checked after every step; every call kvcore cannot honour
raises a typed error and changes nothing."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from kvcore.errors import BlockStateError, InvalidArgumentError, NoFreeBlocksError
from kvcore.integrations.vllm.manager import KVCacheManagerAdapter
from kvcore.integrations.vllm.settings import parse_settings
from kvcore.integrations.vllm.views import BlockView
from kvcore.testing.snapshot import manager_snapshot
from tests.integrations.vllm.helpers import admit, kv_config, managers, request

NUM_BLOCKS = 16


def _state(m: Any) -> tuple[Any, ...]:
    """What a caller of the pool can observe: per block (the null block's ``ref_cnt`` aside:
    vLLM 0.32 counts touches of it, kvcore never does) its references, vLLM's key and the
    prefix a partial entry covers; the free order; the free count."""
    pool = m.block_pool
    size = m.coordinator.single_type_managers[0].block_size
    blocks = [pool.blocks[i] for i in range(1, NUM_BLOCKS)]
    # A full block's hash covers a whole number of blocks (vLLM records how many, kvcore
    # does not); a partial entry would end inside one (none inside vLLM: the adapter refuses
    # hash blocks smaller than the blocks, so cached_block_hashes_by_block stays empty).
    return ([(b.block_id, b.ref_cnt, b.block_hash,
              None if (b.block_hash_num_tokens or 0) % size == 0 else b.block_hash_num_tokens)
             for b in blocks],
            [b.block_id for b in pool.free_block_queue.get_all_free_blocks()],
            pool.get_num_free_blocks(),
            sorted((k, sorted(v)) for k, v in pool.cached_block_hashes_by_block.items()))


def _walk(m: Any, cursor: Any = None) -> list[int]:
    return [b.block_id for b in m.block_pool.free_block_queue.iter_blocks_after(cursor)]


def _world(*ms: Any) -> list[tuple[Any, Any, Any]]:
    """The same requests through each manager: 'a' (3 blocks) running, 'b' (a 2-block prefix
    of its own) and 'c' finished, so free blocks are cached in a known order."""
    out = []
    for m in ms:
        a = request("a", range(40))
        admit(m, a)
        b = request("b", range(100, 140))
        admit(m, b)
        c = request("c", range(200, 236))
        admit(m, c)
        m.free(b)
        m.free(c)
        out.append((a, b, c))
    return out


def _both(theirs: Any, ours: Any, step: Callable[[Any], Any]) -> Any:
    """One step on both; its results and the observable states must be equal, and kvcore's
    invariants hold."""
    got = [step(m) for m in (theirs, ours)]
    assert got[0] == got[1]
    assert _state(theirs) == _state(ours)
    ours.check_invariants()
    return got[1]


def test_touch_free_and_the_free_queue_walk_match_vllms_pool_call_for_call() -> None:
    theirs, ours = managers(kv_config(num_blocks=NUM_BLOCKS))
    reqs = _world(theirs, ours)
    _both(theirs, ours, lambda m: None)
    walk = _both(theirs, ours, _walk)
    assert len(walk) == NUM_BLOCKS - 1 - 3  # 'a' holds 3
    cursor = walk[2]
    _both(theirs, ours, lambda m: _walk(m, m.block_pool.blocks[cursor]))
    # Touch two free cached blocks (one twice in the same call) and one in use.
    b_blocks = ours.get_block_ids("a")[0]
    picked = [walk[-1], walk[-2], walk[-1], b_blocks[0]]
    _both(theirs, ours, lambda m: m.block_pool.touch([m.block_pool.blocks[i] for i in picked]))
    assert ours.kv.withheld_blocks() == {walk[-1]: 2, walk[-2]: 1, b_blocks[0]: 1}
    _both(theirs, ours, _walk)
    # The touched blocks are not reused: a new request takes the head of the walk.
    _both(theirs, ours, lambda m: admit(m, request("d", range(300, 316))))
    _both(theirs, ours, _walk)
    # Return them in order: cached ones go to the end of the walk, the one in use stays used.
    _both(theirs, ours, lambda m: m.block_pool.free_blocks(
        [m.block_pool.blocks[i] for i in (walk[-1], b_blocks[0], walk[-2], walk[-1])]))
    assert ours.kv.withheld_blocks() == {}
    _both(theirs, ours, _walk)
    # Lookups by hash, as the connector re-finds a block that left a sliding window.
    b = reqs[1][1]
    _both(theirs, ours, lambda m: [(x.block_id, x.block_hash) for x in
                                   m.block_pool.get_cached_block(b.block_hashes[1], [0])])
    _both(theirs, ours, lambda m: m.block_pool.get_cached_block(b"\x01" * 32, [0]))
    # The null block is skipped by both (vLLM 0.32 counts its reference; kvcore never does).
    _both(theirs, ours, lambda m: m.block_pool.touch([m.block_pool.null_block]))
    _both(theirs, ours, lambda m: m.block_pool.free_blocks([m.block_pool.null_block]))
    # Walk after each free block, and the cursor vLLM's connector keeps across steps.
    for i in _walk(ours):
        _both(theirs, ours, lambda m, i=i: _walk(m, m.block_pool.blocks[i]))
    # Deferred frees and connector references share free_blocks.
    _both(theirs, ours, lambda m: m.block_pool.touch(m.get_blocks("a").blocks[0][:2]))
    _both(theirs, ours, lambda m: m.block_pool.free_blocks(
        m.pop_blocks_for_free(reqs[m is ours][0])))
    _both(theirs, ours, lambda m: m.block_pool.free_blocks(
        [m.block_pool.blocks[i] for i in b_blocks[1::-1]]))
    assert ours.kv.withheld_blocks() == {} and ours.block_pool.get_num_free_blocks() == 14


def _invalid_world() -> tuple[KVCacheManagerAdapter, Any]:
    _, ours = managers(kv_config(num_blocks=NUM_BLOCKS))
    reqs = _world(ours)[0]
    ours.block_pool.touch([ours.block_pool.blocks[_walk(ours)[-1]]])
    return ours, reqs


def _unhashed_free(m: KVCacheManagerAdapter) -> int:
    return next(i for i in _walk(m) if m.block_pool.blocks[i].block_hash is None)


INVALID: list[tuple[str, Callable[[KVCacheManagerAdapter, Any], Any], type, str]] = [
    ("free a block only a request holds",
     lambda m, r: m.block_pool.free_blocks(m.get_blocks("a").blocks[0][:1]),
     BlockStateError, "withheld 0"),
    ("double free in one call",
     lambda m, r: m.block_pool.free_blocks([m.block_pool.blocks[_walk_all_touched(m)]] * 2),
     BlockStateError, "returned 2 time"),
    ("touch a free block that caches nothing",
     lambda m, r: m.block_pool.touch([m.block_pool.blocks[_unhashed_free(m)]]),
     BlockStateError, "in use by nobody"),
    ("touch a valid block and then another pool's",
     lambda m, r: m.block_pool.touch([m.block_pool.blocks[_walk(m)[-1]], object()]),
     BlockStateError, "not a block of this pool"),
    ("touch another manager's block", lambda m, r: m.block_pool.touch(
        [_other().block_pool.blocks[3]]), BlockStateError, "not a block of this pool"),
    ("free a valid return and then an unknown object", lambda m, r: m.block_pool.free_blocks(
        [m.block_pool.blocks[_walk_all_touched(m)], "7"]), BlockStateError,
     "not a block of this pool"),
    ("an unknown block id", lambda m, r: m.block_pool.blocks[NUM_BLOCKS], IndexError,
     f"block id {NUM_BLOCKS}"),
    ("a block id that is not an int", lambda m, r: m.block_pool.blocks["3"], IndexError,
     "block id '3'"),
    ("walk after a block in use", lambda m, r: m.block_pool.free_block_queue.iter_blocks_after(
        m.get_blocks("a").blocks[0][0]), BlockStateError, "not free"),
    ("walk after the null block", lambda m, r: m.block_pool.free_block_queue.iter_blocks_after(
        m.block_pool.null_block), BlockStateError, "not free"),
    ("walk after another pool's block", lambda m, r: m.block_pool.free_block_queue
     .iter_blocks_after(_other().block_pool.blocks[3]), BlockStateError,
     "not a block of this pool"),
    ("a free count above the free blocks", lambda m, r: setattr(
        m.block_pool.free_block_queue, "num_free_blocks", NUM_BLOCKS), NoFreeBlocksError,
     "held back"),
    ("a negative free count", lambda m, r: setattr(
        m.block_pool.free_block_queue, "num_free_blocks", -1), InvalidArgumentError,
     "num_free_blocks"),
]


def _walk_all_touched(m: KVCacheManagerAdapter) -> int:
    return next(iter(m.kv.withheld_blocks()))


def _other() -> KVCacheManagerAdapter:
    return managers(kv_config(num_blocks=NUM_BLOCKS))[1]


@pytest.mark.parametrize("case", INVALID, ids=[c[0] for c in INVALID])
def test_a_call_kvcore_cannot_honour_raises_and_changes_nothing(case: Any) -> None:
    _, call, error, match = case
    ours, reqs = _invalid_world()
    before = (manager_snapshot(ours.kv), _state(ours), _walk(ours))
    with pytest.raises(error, match=match):
        call(ours, reqs)
    assert (manager_snapshot(ours.kv), _state(ours), _walk(ours)) == before
    ours.check_invariants()


@pytest.mark.parametrize("policy", ["lru", "slru", "s3fifo", "arc", "learned", "recommended"])
def test_the_walk_is_the_order_kvcore_reuses_blocks_in(policy: str) -> None:
    """Under every policy the walk is the free side in kvcore's reuse order (the policy's,
    then the hint reserve): its first block is the next one an allocation takes, a walk after
    a cursor is the rest of it, and a connector's references are pinned without an access."""
    _, ours = managers(kv_config(num_blocks=NUM_BLOCKS),
                       settings=parse_settings({"eviction_policy": policy}))
    _world(ours)
    if policy == "recommended":  # a declared prefix: its free blocks wait in the reserve
        ours.declare_upcoming([request("x", range(100, 140))])
        assert len(ours.kv.pool.reserve)
    walk = _walk(ours)
    assert walk == [b.block_id for b in ours.block_pool.free_block_queue.get_all_free_blocks()]
    for k, i in enumerate(walk):
        assert _walk(ours, ours.block_pool.blocks[i]) == walk[k + 1:]
    views = ours.block_pool.blocks
    cached = [i for i in walk if views[i].block_hash is not None]
    marks = _marks(ours)
    ours.block_pool.touch([views[i] for i in cached])
    ours.check_invariants()
    assert _marks(ours) == marks  # no access recorded
    assert set(_walk(ours)).isdisjoint(cached)
    ours.block_pool.free_blocks([views[i] for i in cached])
    ours.check_invariants()
    assert sorted(_walk(ours)) == sorted(walk)
    first = _walk(ours)[0]
    assert admit(ours, request("n", range(500, 510)))[1][0] == [first]
    ours.check_invariants()


def _marks(m: KVCacheManagerAdapter) -> list[int]:
    policy = m.kv.pool.policy
    mark = getattr(policy, "mark", None)
    return [] if mark is None else [mark(b) for b in m.kv.pool.blocks]


def test_block_views_stand_for_kvcores_blocks() -> None:
    _, ours = managers(kv_config(num_blocks=NUM_BLOCKS))
    a = request("a", range(40))
    admit(ours, a)
    ours.cache_blocks(a, 32)
    raw = ours.get_blocks("a").blocks[0]
    views = ours.block_pool.blocks
    assert len(views) == NUM_BLOCKS and views[-1].block_id == NUM_BLOCKS - 1
    assert [v.block_id for v in views[1:3]] == [1, 2]
    for block in raw:
        view = views[block.block_id]
        assert view is views[block.block_id] and isinstance(view, BlockView)
        assert view == block and block == view and hash(view) == hash(block)
        assert view in set(raw) and view.block is block
        assert view.block_hash == block._block_hash == view._block_hash
        assert view.ref_cnt == block.ref_cnt and view.is_null is False
    assert views[0].is_null and views[0] == ours.block_pool.null_block
    assert views[1] != views[2] and views[1] != object()
    assert "BlockView" in repr(views[1])


def test_setting_the_free_count_exhausts_the_pool_as_vllms_tests_do() -> None:
    """vLLM's offloading tests set ``free_block_queue.num_free_blocks`` to 0 to exhaust the
    pool, and back to its first value later: allocations fail alike, blocks freed meanwhile
    count alike, and once set back every block is free again (a prefix-cache reset works)."""
    theirs, ours = managers(kv_config(num_blocks=NUM_BLOCKS))
    reqs = _world(theirs, ours)
    empty = [m.block_pool.free_block_queue.num_free_blocks for m in (theirs, ours)]
    free = [sorted(_walk(m)) for m in (theirs, ours)]
    assert empty[0] == empty[1] and free[0] == free[1]
    for m in (theirs, ours):
        m.block_pool.free_block_queue.num_free_blocks = 0
    ours.check_invariants()
    counts = [(m.block_pool.get_num_free_blocks(), m.usage) for m in (theirs, ours)]
    assert counts[0] == counts[1] == (0, 1.0)
    grown = [m.allocate_slots(r[0], 17) for m, r in zip((theirs, ours), reqs)]
    assert grown == [None, None]
    for m, r in zip((theirs, ours), reqs):  # preempted: its blocks are free again
        m.free(r[0])
    assert [m.block_pool.get_num_free_blocks() for m in (theirs, ours)] == [3, 3]
    for m, n in zip((theirs, ours), empty):
        m.block_pool.free_block_queue.num_free_blocks = n + 3
    assert ours.kv.num_held_free_blocks == 0
    assert [m.block_pool.get_num_free_blocks() for m in (theirs, ours)] == [NUM_BLOCKS - 1] * 2
    ours.check_invariants()
    assert [m.reset_prefix_cache() for m in (theirs, ours)] == [True, True]
