"""Cache-aware admission inside vLLM (``additional_config["kvcore"]["schedule_policy"]``): the
queue on hand-built waiting lists, then vLLM's real Scheduler and AsyncScheduler admitting from
it."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.request_queue import FCFSRequestQueue
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus

from kvcore.errors import UnsupportedFeatureError
from kvcore.integrations.vllm.queue import CacheAwareQueue
from kvcore.integrations.vllm.replay import Engine, ReplaySetup, make_scheduler
from kvcore.integrations.vllm.settings import parse_settings
from tests.integrations.vllm.helpers import request


class Estimates:
    """Stands in for the adapter: a fixed cached-prefix estimate per request id."""

    def __init__(self, hits: dict[str, int]) -> None:
        self.hits = hits
        self.calls: list[str] = []

    def cached_prefix_tokens(self, req: Request) -> int:
        self.calls.append(req.request_id)
        return self.hits.get(req.request_id, 0)


def _queue(policy: str, hits: dict[str, int], **raw: Any) -> tuple[CacheAwareQueue, Estimates]:
    est = Estimates(hits)
    return CacheAwareQueue(est, parse_settings({"schedule_policy": policy, **raw})), est


def _ids(queue: Any) -> list[str]:
    return [r.request_id for r in queue]


def _fresh(rid: str, tokens: list[int] | None = None) -> Request:
    return request(rid, tokens if tokens is not None else [hash(rid) % 400 + 1] * 40)


def test_lpm_orders_fresh_requests_by_cached_prefix_ties_in_arrival_order() -> None:
    q, _ = _queue("lpm", {"b": 64, "c": 16, "e": 64})
    for rid in "abcde":
        q.add_request(_fresh(rid))
    q.reorder()
    assert _ids(q) == ["b", "e", "c", "a", "d"]
    assert q.peek_request().request_id == "b" and q.pop_request().request_id == "b"


def test_requests_holding_their_place_stay_at_the_head_in_vllms_order() -> None:
    q, _ = _queue("lpm", {"fresh-hit": 160})
    q.add_request(_fresh("fresh-miss"))
    q.add_request(_fresh("fresh-hit"))
    pre = _fresh("preempted")
    pre.status = RequestStatus.PREEMPTED
    fsm = _fresh("grammar")
    fsm.status = RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR
    computed = _fresh("computed")
    computed.num_computed_tokens = 16
    for r in (computed, fsm, pre):  # vLLM prepends what it preempted or skipped
        q.prepend_request(r)
    q.reorder()
    assert _ids(q) == ["preempted", "grammar", "computed", "fresh-hit", "fresh-miss"]


def test_the_estimates_are_refreshed_at_most_lpm_lookups_per_step() -> None:
    q, est = _queue("lpm", {}, lpm_lookups_per_step=2)
    for rid in "abcde":
        q.add_request(_fresh(rid))
    q.reorder()
    assert est.calls == ["a", "b"]  # never looked up first, in arrival order
    est.hits["e"] = 48
    q.reorder()
    assert est.calls[2:] == ["c", "d"]
    q.reorder()
    assert est.calls[4:] == ["e", "a"]  # then the stalest
    assert _ids(q)[0] == "e"


def test_a_request_past_max_waiting_steps_goes_ahead_of_every_fresh_one() -> None:
    q, _ = _queue("lpm", {"hit1": 64, "hit2": 64}, max_waiting_steps=2)
    q.add_request(_fresh("cold"))
    q.add_request(_fresh("hit1"))
    for _ in range(3):  # steps 0, 1, 2: cold has waited 2 steps, not more
        q.reorder()
        assert _ids(q)[-1] == "cold"
    q.add_request(_fresh("hit2"))
    q.reorder()  # step 3: waited 3 > 2
    assert _ids(q) == ["cold", "hit1", "hit2"]


def test_dfs_weight_groups_the_waiting_requests_by_shared_prefix() -> None:
    p, o = list(range(1, 33)), list(range(100, 132))
    q, est = _queue("dfs-weight", {})
    for rid, tokens in [("p1", p + [1] * 16), ("o1", o + [2] * 16), ("p2", p + [3] * 16),
                        ("o2", o + [4] * 16), ("p3", p + [5] * 16), ("x", [7] * 48)]:
        q.add_request(_fresh(rid, tokens))
    q.reorder()
    assert _ids(q) == ["p1", "p2", "p3", "o1", "o2", "x"]
    assert est.calls == []  # no lookup: the waiting requests' own hashes


def test_vllms_queue_operations_keep_working_between_reorders() -> None:
    q, _ = _queue("lpm", {"c": 32})
    reqs = {rid: _fresh(rid) for rid in "abcd"}
    for r in reqs.values():
        q.add_request(r)
    q.reorder()
    assert _ids(q) == ["c", "a", "b", "d"] and len(q) == 4 and q
    q.remove_request(reqs["a"])
    q.remove_requests([reqs["d"]])
    skipped = [q.pop_request(), q.pop_request()]
    q.prepend_requests(reversed(skipped))  # as vLLM puts a step's skipped requests back
    assert _ids(q) == ["c", "b"]
    assert isinstance(q, FCFSRequestQueue)


def test_bad_settings_are_refused_naming_the_value() -> None:
    with pytest.raises(ValueError, match=r"schedule_policy.*'lifo'"):
        parse_settings({"schedule_policy": "lifo"})
    with pytest.raises(ValueError, match=r"max_waiting_steps.*0"):
        parse_settings({"schedule_policy": "lpm", "max_waiting_steps": 0})
    with pytest.raises(ValueError, match=r"lpm_lookups_per_step.*True"):
        parse_settings({"lpm_lookups_per_step": True})


# -- vLLM's scheduler admitting from the queue ---------------------------------------------------
BLOCK = 16
SETUP = ReplaySetup(block_size=BLOCK, num_blocks=64, max_num_seqs=1, max_num_batched_tokens=256)


def _engine(**raw: Any) -> Engine:
    return Engine("kvcore", parse_settings(raw))


def _drive(sched: Any) -> list[str]:
    """Run ``sched`` with one token per finished prefill until nothing is left; the request
    ids in the order they were first scheduled."""
    admitted: list[str] = []
    in_flight: list[tuple[Any, Any]] = []
    depth = 2 if isinstance(sched, AsyncScheduler) else 1  # step N reported after N+1
    while sched.has_unfinished_requests() or in_flight:
        if sched.has_unfinished_requests():
            so = sched.schedule()
            admitted += [r.req_id for r in so.scheduled_new_reqs]
            ids = list(so.num_scheduled_tokens)
            sampled = [[] if sched.requests[r].num_computed_tokens < sched.requests[r].num_tokens
                       else [5] for r in ids]
            in_flight.append((so, ModelRunnerOutput(
                req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                sampled_token_ids=sampled)))
            if len(in_flight) < depth and so.total_num_scheduled_tokens:
                continue
        sched.update_from_output(*in_flight.pop(0))
    return admitted


def _add(sched: Any, rid: str, tokens: list[int]) -> None:
    sched.add_request(request(rid, tokens, BLOCK, sampling_params=SamplingParams(
        max_tokens=2, ignore_eos=True)))


SHARED = list(range(1, 65))  # 4 blocks


def _admissions(policy: str, async_scheduling: bool) -> list[str]:
    sched = make_scheduler(replace(SETUP, async_scheduling=async_scheduling),
                           _engine(schedule_policy=policy))
    _add(sched, "warm", [*SHARED, 500])
    _drive(sched)  # the shared prefix is cached now
    for rid, tokens in [("a0", [200 + i for i in range(70)]), ("b0", [*SHARED, 600, 601]),
                        ("a1", [300 + i for i in range(70)]), ("b1", [*SHARED, 700]),
                        ("a2", [400 - i for i in range(70)])]:
        _add(sched, rid, tokens)
    return _drive(sched)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_vllms_scheduler_admits_in_the_queues_order(async_scheduling: bool) -> None:
    lpm = _admissions("lpm", async_scheduling)
    assert lpm == ["b0", "b1", "a0", "a1", "a2"]
    assert _admissions("fcfs", async_scheduling) == ["a0", "b0", "a1", "b1", "a2"]


def test_fcfs_keeps_vllms_own_queue() -> None:
    sched = make_scheduler(SETUP, _engine(schedule_policy="fcfs"))
    assert type(sched.waiting) is FCFSRequestQueue and sched.kvcore_queue is None
    sched = make_scheduler(SETUP, _engine(schedule_policy="recommended"))
    assert sched.waiting is sched.kvcore_queue and sched.kvcore_queue.order.policy == "lpm"


class DeclarationSpy:
    """Stands in for the adapter (whose methods the compiled build does not let a test
    replace): records every ``declare_upcoming``, forwards everything."""

    def __init__(self, manager: Any, declared: list[list[str]]) -> None:
        self._manager = manager
        self._declared = declared

    def declare_upcoming(self, requests: Any) -> None:
        requests = list(requests)
        self._declared.append([r.request_id for r in requests])
        self._manager.declare_upcoming(requests)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._manager, name)


def test_the_queue_hints_follow_the_new_order() -> None:
    sched = make_scheduler(SETUP, _engine(schedule_policy="lpm", queue_hints=1))
    _add(sched, "warm", [*SHARED, 500])
    _drive(sched)
    declared: list[list[str]] = []
    sched.kv_cache_manager = DeclarationSpy(sched.kv_cache_manager, declared)
    _add(sched, "cold", [900 + i for i in range(40)])
    _add(sched, "hit", [*SHARED, 800])
    sched.schedule()
    assert declared[0] == ["hit"]


def test_vllms_priority_policy_is_refused_with_a_cache_aware_order() -> None:
    with pytest.raises(UnsupportedFeatureError, match=r"'lpm'.*'priority'"):
        make_scheduler(replace(SETUP, scheduling_policy="priority"),
                       _engine(schedule_policy="lpm"))
    sched = make_scheduler(replace(SETUP, scheduling_policy="priority"), _engine())
    assert sched.kvcore_queue is None
