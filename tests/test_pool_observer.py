"""The pool's observer (kvcore.pool.observer) and the admission watermark of
``KVCacheManager.allocate_slots``: what each reports or keeps free, in kvcore's own manager.
(Against vLLM, call for call: tests/integrations/vllm/test_admission_metrics_embeds.py.)"""

from __future__ import annotations

import pytest

from kvcore.errors import InvalidArgumentError
from kvcore.types import KVCacheBlock
from tests.factories import admit, full_spec, make_manager, manager_snapshot


class Recorder:
    """Every call, as (name, block id)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    def on_block_allocated(self, block: KVCacheBlock) -> None:
        self.calls.append(("allocated", block.block_id))

    def on_block_accessed(self, block: KVCacheBlock) -> None:
        self.calls.append(("accessed", block.block_id))

    def on_block_evicted(self, block: KVCacheBlock) -> None:
        self.calls.append(("evicted", block.block_id))

    def reset(self) -> None:
        self.calls.append(("reset", -1))


@pytest.mark.parametrize("caching", [True, False])
def test_allocation_hit_eviction_and_reset_are_reported(caching: bool) -> None:
    m = make_manager(full_spec(4), num_blocks=8, enable_caching=caching)
    seen = Recorder()
    m.pool.set_observer(seen)
    assert m.pool.observer is seen
    a = m.make_request("a", list(range(10)))
    assert admit(m, a) is not None
    # With caching, each handed-out block is first reported evicted (cached or not).
    per_block = [("evicted", i) for i in (1, 2, 3)] if caching else []
    expected = []
    for i in (1, 2, 3):
        expected += [c for c in per_block if c[1] == i] + [("allocated", i)]
    assert seen.calls == expected
    seen.calls.clear()
    m.free(a)
    b = m.make_request("b", list(range(10)))
    admit(m, b)
    if caching:  # the two full blocks are hit; the uncached third, freed first, is reused
        assert seen.calls == [("accessed", 1), ("accessed", 2), ("evicted", 3), ("allocated", 3)]
    m.free(b)
    seen.calls.clear()
    m.evict_blocks([3, 1])  # every id listed, cached or not, in order
    assert seen.calls == [("evicted", 3), ("evicted", 1)]
    seen.calls.clear()
    assert m.reset_prefix_cache()
    assert seen.calls == [("reset", -1)]


def test_pins_are_not_reported_and_a_bad_observer_changes_nothing() -> None:
    m = make_manager(full_spec(4), num_blocks=8)
    seen = Recorder()
    m.pool.set_observer(seen)
    a = m.make_request("a", list(range(8)))
    admit(m, a)
    seen.calls.clear()
    m.withhold(m.get_blocks("a")[0])  # a copy (KV offload) is no access
    assert seen.calls == []
    before = manager_snapshot(m)
    with pytest.raises(InvalidArgumentError, match="callable on_block_evicted"):
        m.pool.set_observer(type("Half", (), {"on_block_allocated": lambda s, b: None,
                                              "on_block_accessed": lambda s, b: None})())
    assert m.pool.observer is seen and manager_snapshot(m) == before
    m.pool.set_observer(None)
    assert m.pool.observer is None


def test_the_watermark_keeps_blocks_free_also_for_full_sequence_checks() -> None:
    m = make_manager(full_spec(4), num_blocks=9)  # 8 usable
    a = m.make_request("a", list(range(14)))
    before = manager_snapshot(m)
    assert m.allocate_slots(a, 13, watermark_blocks=5) is None  # 4 + 5 > 8
    assert m.allocate_slots(a, 4, full_sequence_must_fit=True, watermark_blocks=5) is None
    assert manager_snapshot(m) == before
    assert m.allocate_slots(a, 13, watermark_blocks=4) is not None  # 4 + 4 <= 8
    a.num_computed_tokens = 13
    # A tracked request that needs no new block still finds the watermark (or a reserve)
    # unavailable, as vLLM checks it: 0 + 5 > 4 free.
    before = manager_snapshot(m)
    assert m.allocate_slots(a, 1, watermark_blocks=5) is None
    assert m.allocate_slots(a, 1, reserved_blocks=5) is None
    assert manager_snapshot(m) == before
    assert m.allocate_slots(a, 1, watermark_blocks=4) is not None
    b = m.make_request("b", list(range(8)))
    assert m.allocate_slots(b, 8, watermark_blocks=2) is not None  # 2 + 2 <= 4
    assert m.num_free_blocks == 2
