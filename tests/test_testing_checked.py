"""kvcore.testing.checked: invariants after every public call, named by the call; the content
oracle catches a wrong-KV hit."""

from __future__ import annotations

import pytest

from kvcore import KVCacheManager
from kvcore.errors import InvalidArgumentError, InvariantError
from kvcore.scheduler import Scheduler, SchedulerConfig
from kvcore.testing import CollidingHasher
from kvcore.testing.checked import checked, is_checked, unchecked
from tests.factories import full_spec, make_config, make_manager, swa_spec


def test_a_checked_manager_is_the_same_object_and_behaves_the_same() -> None:
    m = make_manager(full_spec(4), num_blocks=32, max_model_len=64)
    assert checked(m, track_contents=True) is m
    assert isinstance(m, KVCacheManager) and is_checked(m)
    sched = Scheduler(m, SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16))
    for i in range(6):
        sched.add_request(m.make_request(f"r{i}", [1, 2, 3, 4, 5, 6, 7, 8, i], max_tokens=5))
    steps = 0
    while sched.has_unfinished_requests():
        out = sched.schedule()
        sched.update_from_output(out, {s.request_id: 3 for s in out.scheduled if s.samples})
        steps += 1
    assert steps < 100 and m.num_free_blocks == 31
    assert m._kvcore_check.calls > 20  # type: ignore[attr-defined]
    assert unchecked(m) is m and type(m) is KVCacheManager and not is_checked(m)


def test_a_corruption_is_reported_with_the_call_after_which_it_was_seen() -> None:
    m = checked(make_manager(full_spec(4), num_blocks=16))
    a = m.make_request("a", list(range(10)))
    m.allocate_slots(a, 10)
    a.num_computed_tokens = 10
    m.get_blocks("a")[0][0].ref_cnt += 1  # a bug outside the manager
    a.append_output_token_ids(5)
    with pytest.raises(InvariantError) as info:
        m.allocate_slots(a, 1)
    assert info.value.rule == "ref-count"
    assert "after allocate_slots(<request 'a'>, 1)" in str(info.value)


def test_every_nth_call() -> None:
    m = checked(make_manager(full_spec(4), num_blocks=16), every=3)
    a = m.make_request("a", list(range(6)))
    m.allocate_slots(a, 6)
    m.get_blocks("a")[0][0].ref_cnt += 1
    m.get_block_ids("a")  # not a checked call
    m.take_events()  # call 2: no check yet
    with pytest.raises(InvariantError, match="after make_prefix_cache_stats"):
        m.make_prefix_cache_stats()  # call 3


def test_the_content_oracle_catches_a_wrong_kv_hit() -> None:
    # Without verify_hits kvcore trusts the hash; a parent-blind hash makes B's window block
    # collide with A's (equal tokens after another prefix): the oracle sees the wrong KV.
    m = KVCacheManager(make_config(swa_spec(4, 4), num_blocks=32), 64,
                       block_hasher=CollidingHasher("tokens"))
    checked(m, track_contents=True)
    a = m.make_request("a", [1, 1, 1, 1, 7, 7, 7, 7, 0])
    m.allocate_slots(a, 9)
    a.num_computed_tokens = 9
    m.free(a)
    b = m.make_request("b", [2, 2, 2, 2, 7, 7, 7, 7, 0])
    blocks, hit = m.get_computed_blocks(b)
    assert hit == 8
    with pytest.raises(InvariantError) as info:
        m.allocate_slots(b, 1, hit, blocks)
    assert info.value.rule == "wrong-kv" and "holds KV of another prefix" in str(info.value)


def test_checked_works_for_subclasses_and_refuses_bad_arguments() -> None:
    class Mine(KVCacheManager):
        def free(self, request):  # type: ignore[no-untyped-def]
            self.freed = getattr(self, "freed", 0) + 1
            super().free(request)

    m = checked(Mine(make_config(full_spec(4), num_blocks=16), 64))
    a = m.make_request("a", [1, 2, 3])
    m.allocate_slots(a, 3)
    m.free(a)
    assert m.freed == 1 and isinstance(m, Mine) and is_checked(m)
    assert type(unchecked(m)) is Mine
    with pytest.raises(InvalidArgumentError, match="every"):
        checked(m, every=0)
    with pytest.raises(InvalidArgumentError, match="KVCacheManager"):
        checked("nope")  # type: ignore[type-var]
    busy = make_manager(full_spec(4))
    busy.allocate_slots(busy.make_request("x", [1]), 1)
    with pytest.raises(InvalidArgumentError, match="holds no request"):
        checked(busy, track_contents=True)


def test_planted_collisions_refuse_allocation_and_manual_clock() -> None:
    from kvcore.testing import ManualClock, PlantedCollisions, refuse_allocation

    hasher = PlantedCollisions()
    hasher.collide([9, 9, 9, 9], as_tokens=[1, 2, 3, 4])
    assert hasher.hash_block(None, [9, 9, 9, 9]) == hasher.hash_block(None, [1, 2, 3, 4])
    assert hasher.hash_block(None, [8, 8, 8, 8]) != hasher.hash_block(None, [1, 2, 3, 4])
    m = KVCacheManager(make_config(full_spec(4), num_blocks=16), 64, block_hasher=hasher,
                       verify_hits=True)
    a = m.make_request("a", [1, 2, 3, 4, 0])
    m.allocate_slots(a, 5)
    a.num_computed_tokens = 5
    b = m.make_request("b", [9, 9, 9, 9, 0])
    assert b.block_hashes == a.block_hashes[:1]  # the planted collision
    assert m.get_computed_blocks(b)[1] == 0  # ... which verify_hits refuses

    refuse_allocation(m, calls={2})
    c, d = m.make_request("c", [5, 6]), m.make_request("d", [7, 8])
    assert m.allocate_slots(c, 2) is not None
    assert m.allocate_slots(d, 2) is None and "d" not in m.requests()  # refused, unchanged
    assert m.allocate_slots(d, 2) is not None

    clock = ManualClock(1.5)
    assert clock.now() == 1.5 and clock.advance(2) == 3.5 and clock.sleep(0.5) == 4.0
    with pytest.raises(InvalidArgumentError):
        clock.advance(float("nan"))
