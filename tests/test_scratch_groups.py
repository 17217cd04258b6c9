"""Scratch KV-cache groups in kvcore's core (vLLM's ``prefix_cacheable`` false): sliding windows
rebuilt by bounded replay (``SlidingWindowSpec(bounded_replay=True)``, DeepSeek-V4) and circular
buffers (``CircularBufferSpec``, the CSA compressor ring).  The vLLM differential traces of
these groups are in tests/integrations/vllm/test_differential_adapter.py."""

from __future__ import annotations

import pytest
import torch

from kvcore.errors import InvalidArgumentError, InvariantError, UnsupportedFeatureError
from kvcore.manager import KVCacheManager
from kvcore.managers import CircularBufferManager
from kvcore.scheduler import Scheduler
from kvcore.specs import (
    CircularBufferSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroup,
    KVCacheSpec,
    SlidingWindowSpec,
)

BS = 16
WINDOW = 32


def _full(bs: int = BS) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=bs, num_kv_heads=1, head_size=8, dtype=torch.float16)


def _replayed(window: int = WINDOW, bs: int = BS) -> SlidingWindowSpec:
    return SlidingWindowSpec(block_size=bs, num_kv_heads=1, head_size=8, dtype=torch.float16,
                             sliding_window=window, bounded_replay=True)


def _ring(bs: int = 8) -> CircularBufferSpec:
    return CircularBufferSpec(block_size=bs, num_kv_heads=1, head_size=8, dtype=torch.float16)


def _config(*specs: KVCacheSpec, num_blocks: int = 64) -> KVCacheConfig:
    return KVCacheConfig(num_blocks, tuple(KVCacheGroup((f"l{i}",), s)
                                           for i, s in enumerate(specs)))


def _ids(m: KVCacheManager, rid: str) -> list[list[int]]:
    return [list(g) for g in m.get_block_ids(rid)]


def test_specs_say_what_is_scratch_and_what_replays() -> None:
    assert _full().prefix_cacheable and _full().prefix_replay_tokens == 0
    plain = SlidingWindowSpec(block_size=BS, num_kv_heads=1, head_size=8, sliding_window=WINDOW)
    assert plain.prefix_cacheable and plain.prefix_replay_tokens == 0
    assert not _replayed().prefix_cacheable and _replayed().prefix_replay_tokens == WINDOW
    assert not _ring().prefix_cacheable and _ring().prefix_replay_tokens == 0
    assert _ring().max_blocks_per_request(4096) == 1
    # Hashes at the gcd of the cacheable groups; hits aligned to the lcm of all (vLLM's
    # scheduler block size), the replay window is the replayed groups'.
    config = _config(_full(4), _replayed(bs=8), _ring(16))
    assert (config.hash_block_size, config.alignment_tokens) == (4, 16)
    assert config.prefix_replay_tokens == WINDOW
    assert _config(_full()).prefix_replay_tokens == 0


@pytest.mark.parametrize(("make", "match"), [
    (lambda: SlidingWindowSpec(block_size=BS, num_kv_heads=1, head_size=8, sliding_window=8,
                               bounded_replay=1), "bounded_replay must be a bool, got 1"),
    (lambda: _config(_full(), _replayed(32), _replayed(64)), r"one window .* \[32, 64\]"),
    (lambda: CircularBufferSpec(block_size=0, num_kv_heads=1, head_size=8), "block_size"),
])
def test_bad_scratch_configurations_are_refused_naming_the_value(make, match) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(InvalidArgumentError, match=match):
        make()


def test_a_hit_replays_the_window_into_fresh_blocks() -> None:
    """vLLM's test_hit_replays_window_without_reallocating, at the manager: the full-attention
    hit is shared, the replayed window never hits (nulls below the window of the hit's next
    token, fresh blocks for the window and the new tokens), and replay-only chunks take
    nothing more."""
    m = KVCacheManager(_config(_full(), _replayed()), 4096)
    first = m.make_request("first", [0] * 100)
    m.allocate_slots(first, 100)
    first.num_computed_tokens = 100
    second = m.make_request("second", [0] * 100)
    hit, n = m.get_computed_blocks(second)
    assert n == 96 and [len(g) for g in hit] == [6, 0]
    replay = min(m.config.prefix_replay_tokens, n)
    new = m.allocate_slots(second, 100 - (n - replay) - replay, n, hit)  # tokens past the hit
    assert new is not None
    second.num_computed_tokens = n - replay
    full_ids, window_ids = _ids(m, "second")
    assert full_ids[:6] == _ids(m, "first")[0][:6] and len(full_ids) == 7
    assert window_ids[:4] == [0] * 4 and 0 not in window_ids[4:] and len(window_ids) == 7
    m.check_invariants()
    before = m.num_free_blocks
    assert not any(m.allocate_slots(second, 16))  # a replay-only chunk: slots exist
    second.num_computed_tokens += 16
    assert m.num_free_blocks == before
    m.check_invariants()
    # Nothing of the window group was ever cached or published.
    assert all(b.block_hash is None for b in m.coordinator.managers[1].req_to_blocks["first"])


def test_the_ring_is_one_block_taken_once_and_held_until_free() -> None:
    m = KVCacheManager(_config(_full(), _ring()), 4096, enable_events=True)
    assert isinstance(m.coordinator.managers[1], CircularBufferManager)
    a = m.make_request("a", list(range(40)))
    new = m.allocate_slots(a, 20)
    assert new is not None and [len(g) for g in new.get_block_ids()] == [2, 1]
    ring = _ids(m, "a")[1]
    a.num_computed_tokens = 20
    for _ in range(3):  # growth never adds a ring block
        new = m.allocate_slots(a, 8)
        assert new is None or not new.get_block_ids()[1]
        a.num_computed_tokens += 8
    assert _ids(m, "a")[1] == ring
    m.check_invariants()
    # A prefix hit gives the ring group nothing; the newcomer takes its own ring.
    b = m.make_request("b", list(range(40)))
    hit, n = m.get_computed_blocks(b)
    assert n == 32 and not hit[1]
    new = m.allocate_slots(b, 8, n, hit)
    assert new is not None and len(new.get_block_ids()[1]) == 1
    assert _ids(m, "b")[1] != ring
    # Tokens computed elsewhere claim the ring too (no new tokens: an async load).
    c = m.make_request("c", [7] * 40)
    assert m.allocate_slots(c, 0, num_external_computed_tokens=16, delay_cache_blocks=True)
    assert len(_ids(m, "c")[1]) == 1
    m.check_invariants()
    free = m.num_free_blocks
    m.free(a)
    # a's third full-attention block and its ring (b shares the first two)
    assert m.num_free_blocks == free + 2
    events = m.take_events()
    assert events and all(getattr(e, "group_id", 0) == 0 for e in events)


def test_invariants_cover_scratch_groups() -> None:
    m = KVCacheManager(_config(_full(), _replayed(), _ring()), 4096)
    a = m.make_request("a", [1] * 40)
    m.allocate_slots(a, 40)
    a.num_computed_tokens = 40
    m.check_invariants()
    ring_table = m.coordinator.managers[2].req_to_blocks["a"]
    ring_table.append(m.pool.get_new_blocks(1)[0])
    with pytest.raises(InvariantError, match="holds at most 1"):
        m.check_invariants()
    m.pool.free_blocks([ring_table.pop()], trusted=True)
    m.check_invariants()
    # A scratch block with a hash: as if the group had been cached.
    window = m.coordinator.managers[1]
    m.pool.cache_full_blocks(a, window.req_to_blocks["a"], 0, 1, BS, 1, a.block_hashes,
                             trusted=True)
    with pytest.raises(InvariantError, match="scratch group 1"):
        m.check_invariants()


def test_kvcores_own_scheduler_refuses_bounded_replay_and_runs_rings() -> None:
    """kvcore's Scheduler does not replay hits: with a replayed window and caching on it
    refuses at construction (vLLM's scheduler replays; kvcore runs inside it).  Rings need no
    scheduler support."""
    with pytest.raises(UnsupportedFeatureError, match="32 tokens of bounded replay"):
        Scheduler(KVCacheManager(_config(_full(), _replayed()), 4096))
    Scheduler(KVCacheManager(_config(_full(), _replayed()), 4096, enable_caching=False))
    Scheduler(KVCacheManager(_config(_full(), _ring()), 4096))
