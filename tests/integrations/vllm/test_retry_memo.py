"""The head-of-line retry memo (kvcore.integrations.vllm.retry): vLLM's scheduler asks again
every step for the waiting request that did not fit, and the adapter answers from memory while
nothing that decides the answer changed.

Through vLLM's scheduler, a pressure trace (the queue's head blocked for many steps) gives the
same schedule, stats and event bytes with the memo, without it and with vLLM's own manager, and
the memo answered most retries.  Driven call by call, the three managers answer alike where the
memo must let the retry through: blocks freed, a hit's blocks evicted, the head's next block
cached by a running request, and a hit taken by another admission while a free brings the free
count back to where it was (the need shrank, the free count did not grow)."""

from __future__ import annotations

from typing import Any

import pytest

from kvcore.errors import InvalidArgumentError
from kvcore.integrations.vllm import replay
from kvcore.integrations.vllm.replay import Engine, ReplaySetup, differences, run
from kvcore.integrations.vllm.settings import KvcoreSettings, parse_settings
from kvcore.sim.traces import TraceRequest
from tests.integrations.vllm.helpers import kv_config, managers, request

MEMO = Engine.parse("kvcore")
NO_MEMO = Engine.parse("kvcore+no-memo")
VLLM = Engine.parse("vllm")


def _pressure() -> list[TraceRequest]:
    """Long answers hold the pool while a long prompt waits at the head of the queue."""
    out = [TraceRequest(f"d{i}", 0.0, 48, 120, prompt=tuple(range(i * 100, i * 100 + 48)))
           for i in range(6)]
    out.append(TraceRequest("head", 1.0, 400, 4, prompt=tuple(range(5000, 5400))))
    out += [TraceRequest(f"t{i}", 2.0 + i, 40, 30, prompt=tuple(range(9000 + i, 9040 + i)))
            for i in range(8)]
    return out


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_blocked_head_gets_the_same_schedule_with_the_memo(
        async_scheduling: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[Any] = []
    make = replay.make_scheduler
    monkeypatch.setattr(replay, "make_scheduler", lambda *a: made.append(make(*a)) or made[-1])
    setup = ReplaySetup(block_size=16, num_blocks=48, max_model_len=1024, max_num_seqs=12,
                        max_num_batched_tokens=512, async_scheduling=async_scheduling)
    requests = _pressure()
    theirs = run(requests, setup, VLLM, record=True)
    ours = run(requests, setup, MEMO, record=True)
    memo = made[-1].kv_cache_manager.retry_memo
    plain = run(requests, setup, NO_MEMO, record=True)
    assert made[-1].kv_cache_manager.retry_memo is None
    assert not differences(theirs, ours), differences(theirs, ours)
    assert not differences(plain, ours), differences(plain, ours)
    assert ours.finished == len(requests) and theirs.event_batches and theirs.stats
    # The head waited many steps, and the memo answered most of its retries.
    assert ours.wait_steps["head"] > 40
    assert memo.num_lookups_skipped > 30 and memo.num_allocations_skipped > 30


def test_settings_turn_the_memo_off() -> None:
    assert MEMO.settings is not None and MEMO.settings.retry_memo
    assert NO_MEMO.settings == KvcoreSettings(retry_memo=False) and NO_MEMO.lru
    memo_off = Engine.parse("kvcore:slru+hints=8+no-memo@lpm").settings
    assert memo_off is not None and not memo_off.retry_memo and memo_off.queue_hints == 8
    assert parse_settings({}).retry_memo is True
    assert parse_settings({"retry_memo": False}).retry_memo is False
    with pytest.raises(InvalidArgumentError, match=r"retry_memo.*must be a bool.*'yes'"):
        parse_settings({"retry_memo": "yes"})


# -- call by call ------------------------------------------------------------------------------
P = list(range(1000, 1048))  # a three-block prefix


class _Driver:
    """One manager (vLLM's, or the adapter with or without the memo) and its own requests;
    every call's answer is recorded as block ids."""

    def __init__(self, manager: Any) -> None:
        self.m = manager
        self.reqs: dict[str, Any] = {}
        self.seen: list[Any] = []

    def add(self, rid: str, tokens: list[int]) -> None:
        self.reqs[rid] = request(rid, tokens)

    def try_admit(self, rid: str, num_new_tokens: int | None = None) -> bool:
        """The scheduler's admission of a waiting request: lookup, then allocate."""
        req = self.reqs[rid]
        blocks, hit, _ = self.m.get_computed_blocks(req)
        n = req.num_tokens - hit if num_new_tokens is None else num_new_tokens
        new = self.m.allocate_slots(req, n, hit, blocks)
        self.seen.append((rid, hit, blocks.get_block_ids(),
                          None if new is None else new.get_block_ids()))
        if new is None:
            return False
        self.m.record_prefix_cache_stats(req, hit)
        req.num_computed_tokens = hit + n
        return True

    def grow(self, rid: str, n: int) -> None:
        """The next chunk of a running request's prompt."""
        req = self.reqs[rid]
        new = self.m.allocate_slots(req, n)
        assert new is not None
        req.num_computed_tokens += n
        self.seen.append((rid, new.get_block_ids()))

    def free(self, rid: str) -> None:
        self.m.free(self.reqs.pop(rid))


def _drivers(num_blocks: int) -> list[_Driver]:
    config = kv_config(num_blocks=num_blocks)
    stock, memo = managers(config)
    _, plain = managers(config, settings=KvcoreSettings(retry_memo=False))
    return [_Driver(stock), _Driver(memo), _Driver(plain)]


def _skipped(drivers: list[_Driver]) -> tuple[int, int]:
    memo = drivers[1].m.retry_memo
    return memo.num_lookups_skipped, memo.num_allocations_skipped


def _same(drivers: list[_Driver]) -> None:
    assert drivers[0].seen == drivers[1].seen == drivers[2].seen


def test_a_free_lets_the_head_in_on_the_same_call() -> None:
    drivers = _drivers(num_blocks=11)  # 10 usable blocks
    for d in drivers:
        d.add("a", list(range(96)))  # 6 blocks
        d.add("head", list(range(500, 580)))  # 5 blocks
        assert d.try_admit("a")
        assert [d.try_admit("head") for _ in range(4)] == [False] * 4
    assert _skipped(drivers) == (3, 3)
    for d in drivers:
        d.free("a")
        assert d.try_admit("head")
    _same(drivers)
    assert _skipped(drivers) == (4, 3)  # the lookup was still good; the allocation was not


def test_an_evicted_hit_or_a_newly_cached_block_changes_the_answer() -> None:
    drivers = _drivers(num_blocks=11)  # 10 usable blocks
    for d in drivers:
        d.add("p", [*P, 1])  # caches P's three blocks, then leaves them free
        assert d.try_admit("p")
        d.free("p")
        d.add("a", list(range(64)))  # 4 blocks: 6 free left, P's 3 last in eviction order
        assert d.try_admit("a")
        d.add("b", list(range(3000, 3064)))
        assert d.try_admit("b", 16)  # its first chunk: 5 free left
        d.add("head", [*P, *range(2000, 2064)])  # hits P: 3 free hit + 4 new blocks > 5 free
        assert not d.try_admit("head") and not d.try_admit("head")
    assert _skipped(drivers) == (1, 1)
    for d in drivers:
        d.grow("b", 48)  # 3 blocks, the last of them P's third (evicted; no hit taken)
        assert not d.try_admit("head")  # looked up again: two blocks hit now
    assert [s[1] for s in drivers[1].seen if s[0] == "head"] == [48, 48, 32]
    _same(drivers)
    assert _skipped(drivers) == (1, 1)
    # A running request caches the head's next block: the head's hit grows.
    drivers = _drivers(num_blocks=13)
    for d in drivers:
        d.add("w", [*P, *range(2000, 2016), 9])
        assert d.try_admit("w", 48)  # its first chunk: P's three blocks
        d.add("a", list(range(64)))  # 4 blocks: 12 - 3 - 4 = 5 free
        assert d.try_admit("a")
        d.add("head", [*P, *range(2000, 2064)])  # hits P (in use): 4 new blocks, 5 free
        d.add("c", list(range(4000, 4020)))  # 2 blocks: 3 free left
        assert d.try_admit("c")
        assert not d.try_admit("head") and not d.try_admit("head")
        d.grow("w", 16)  # caches the head's fourth block
        assert not d.try_admit("head")
    assert [s[1] for s in drivers[1].seen if s[0] == "head"] == [48, 48, 64]
    _same(drivers)
    assert _skipped(drivers) == (1, 1)


def test_a_hit_taken_while_a_free_restores_the_free_count_lets_the_head_in() -> None:
    """The head needs its new blocks plus its free hit blocks.  Another admission takes those
    hit blocks (the free count and the need shrink together) and a request finishing brings
    the free count back to where it was: no more free blocks than at the failure, yet the head
    fits now."""
    drivers = _drivers(num_blocks=11)
    for d in drivers:
        d.add("p", [*P, 1])
        assert d.try_admit("p")
        d.free("p")  # P's three blocks cached and free
        d.add("b", list(range(64)))  # 4 blocks: 6 free, P's among them
        assert d.try_admit("b")
        d.add("head", [*P, *range(2000, 2056)])  # 3 free hit + 4 new = 7 > 6 free
        assert not d.try_admit("head") and not d.try_admit("head")
        d.add("x", [*P, 2])  # takes P's blocks and 1 new: 2 free
        assert d.try_admit("x")
        d.free("b")  # 6 free again
        assert d.try_admit("head")  # 4 new blocks now
    _same(drivers)
    assert _skipped(drivers) == (1, 1)  # the hit taken: looked up again


def test_a_pool_change_between_a_lookup_and_its_failure_is_not_remembered() -> None:
    """A failure is remembered only when nothing changed since its lookup: here a running
    request caches more of the head's prefix between the two, so the next retry looks up again
    and finds it."""
    drivers = _drivers(num_blocks=11)
    for d in drivers:
        d.add("a", list(range(96)))
        assert d.try_admit("a")  # 6 blocks
        d.add("w", [*P, 1])
        assert d.try_admit("w", 16)  # P's first block: 3 free left
        d.add("head", [*P, *range(2000, 2040)])
        req = d.reqs["head"]
        blocks, hit, _ = d.m.get_computed_blocks(req)  # one block hit
        d.grow("w", 32)  # caches P's other two blocks: 1 free left
        d.seen.append((hit, d.m.allocate_slots(req, req.num_tokens - hit, hit, blocks)))
        assert not d.try_admit("head")
    assert drivers[1].seen[-2][0] == 16 and drivers[1].seen[-1][1] == 48
    _same(drivers)
    assert _skipped(drivers) == (0, 0)
