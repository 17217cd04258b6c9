"""kvcore.testing catches what its docstrings promise: a scheduler that forgets uncache_blocks
after a failed step (reported with step_failed) is caught before or at the next hit; a hit
passed from a different prefix is refused as such (not as "evicted"), a hit of the request's
own lookup evicted since as stale; SchedulerMachine stops a
stuck scheduler early with "no progress in N steps"."""

from __future__ import annotations

from typing import Any

import pytest

from kvcore.errors import InvalidArgumentError, InvalidHitError, InvariantError, StaleHitError
from kvcore.manager import KVCacheManager
from kvcore.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from kvcore.testing import step_failed
from kvcore.testing.checked import checked
from kvcore.testing.machine import SchedulerMachine
from kvcore.testing.snapshot import manager_snapshot
from kvcore.testing.strategies import RequestSpec
from tests.factories import full_spec, make_manager

PROMPT = list(range(1, 14))  # 13 tokens: 3 full blocks of 4 (12 tokens) are cached at allocation


class Forgetful(Scheduler):
    """A buggy scheduler: after a failed step it aborts the requests but never uncaches."""

    def fail_step(self, output: SchedulerOutput) -> list[Any]:
        for s in output.scheduled:
            self.abort_request(s.request_id)
        return [s.request for s in output.scheduled]


def _tracked(scheduler_cls: type[Scheduler]) -> tuple[KVCacheManager, Scheduler]:
    m = checked(make_manager(full_spec(4), num_blocks=32, max_model_len=64), track_contents=True)
    return m, scheduler_cls(m, SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16))


def test_forgetting_uncache_blocks_after_a_failed_step_is_caught() -> None:
    m, sched = _tracked(Forgetful)
    sched.add_request(m.make_request("a", PROMPT, max_tokens=2))
    out = sched.schedule()
    step_failed(m)  # the engine's forward raised
    sched.fail_step(out)
    sched.add_request(m.make_request("b", PROMPT, max_tokens=2))
    with pytest.raises(InvariantError) as info:
        sched.schedule()  # its new_step: a's never-written blocks are still cached
    assert info.value.rule == "wrong-kv"
    assert "failed step" in str(info.value) and "uncache_blocks" in str(info.value)


def test_a_hit_on_a_failed_steps_blocks_is_caught_at_the_hit() -> None:
    m = checked(make_manager(full_spec(4), num_blocks=32, max_model_len=64), track_contents=True)
    a = m.make_request("a", PROMPT)
    m.allocate_slots(a, 13)
    a.num_computed_tokens = 13
    step_failed(m)
    m.free(a)  # no uncache_blocks, and no new_step before the next lookup
    b = m.make_request("b", PROMPT)
    blocks, hit = m.get_computed_blocks(b)
    assert hit == 12
    with pytest.raises(InvariantError, match="was never written") as info:
        m.allocate_slots(b, 1, hit, blocks)
    assert info.value.rule == "wrong-kv"


def test_kvcores_scheduler_uncaches_a_failed_step_and_passes() -> None:
    m, sched = _tracked(Scheduler)
    sched.add_request(m.make_request("a", PROMPT, max_tokens=2))
    out = sched.schedule()
    step_failed(m)
    sched.fail_step(out)
    b = m.make_request("b", PROMPT, max_tokens=2)
    sched.add_request(b)
    sched.schedule()
    assert b.num_cached_tokens == 0  # nothing never-written was served


def test_step_failed_needs_a_content_tracking_manager() -> None:
    with pytest.raises(InvalidArgumentError, match="track_contents"):
        step_failed(checked(make_manager(full_spec(4))))
    with pytest.raises(InvalidArgumentError, match="track_contents"):
        step_failed(make_manager(full_spec(4)))


def test_a_hit_of_a_different_prefix_is_refused_as_such() -> None:
    m = checked(make_manager(full_spec(4), num_blocks=32, max_model_len=64))
    for rid, first in (("a", 1), ("b", 50)):
        r = m.make_request(rid, [first + i for i in range(9)])
        m.allocate_slots(r, 9)
        r.num_computed_tokens = 9
        m.free(r)
    a_again = m.make_request("a2", [1 + i for i in range(9)])
    b_again = m.make_request("b2", [50 + i for i in range(9)])
    hit_of_a, n = m.get_computed_blocks(a_again)
    assert n == 8
    before = manager_snapshot(m)
    with pytest.raises(InvalidHitError, match="different prefix") as info:
        m.allocate_slots(b_again, 1, n, hit_of_a)  # a's hit, passed for b
    assert "evicted" not in str(info.value) and "'b2'" in str(info.value)
    assert manager_snapshot(m) == before


@pytest.mark.parametrize("track_contents", [False, True])
def test_a_stale_hit_is_refused_as_stale_by_a_checked_manager(track_contents: bool) -> None:
    """checked() leaves the manager's stale-hit error as it is: the hit was this request's own
    lookup, and other allocations evicted and re-cached its blocks before it was used."""
    m = checked(make_manager(full_spec(4), num_blocks=8, max_model_len=64),
                track_contents=track_contents)
    a = m.make_request("a", PROMPT)
    m.allocate_slots(a, 13)
    a.num_computed_tokens = 13
    m.free(a)
    b = m.make_request("b", PROMPT)
    hit, n = m.get_computed_blocks(b)
    assert n == 12
    hog = m.make_request("hog", list(range(100, 128)))  # all 7 blocks: b's hit is re-cached
    m.allocate_slots(hog, 28)
    before = manager_snapshot(m)
    with pytest.raises(StaleHitError, match="the hit went stale between lookup and allocation"):
        m.allocate_slots(b, 1, n, hit)
    assert manager_snapshot(m) == before


class Stuck(SchedulerMachine):
    """A scheduler that never schedules anything."""

    def make_scheduler(self, manager: KVCacheManager) -> Any:
        return Scheduler(manager, SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16))

    def step(self) -> None:
        self.steps = getattr(self, "steps", 0) + 1


def test_a_stuck_scheduler_fails_early_with_no_progress() -> None:
    machine = Stuck()
    machine.submit("r1", RequestSpec((1, 2, 3, 4, 5), 2, None))
    with pytest.raises(AssertionError, match=r"no progress in 50 steps.*'r1'"):
        machine.teardown()
    assert machine.steps == 50  # not max_drain_steps (5,000)
