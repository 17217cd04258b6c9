"""Admission orders of the waiting queue (kvcore.scheduler.admission): each policy's order on
hand-built queues, the pinned head, queue hints in the new order, the bounded lookups of lpm and
the starvation bound; the replay's and the CLI's schedule-policy options."""

from __future__ import annotations

import json
from collections import deque
from typing import Any

import pytest

from kvcore import Request
from kvcore.cli import main as cli_main
from kvcore.errors import InvalidArgumentError
from kvcore.request import RequestStatus
from kvcore.scheduler import Scheduler, SchedulerConfig, holds_place
from kvcore.scheduler.admission import RECOMMENDED, WaitingOrder, dfs_weight_order
from kvcore.sim.replay import ReplayConfig, replay
from kvcore.sim.study import gap_closed, parse_config
from kvcore.sim.workloads import multi_turn
from tests.factories import full_spec, make_manager

BS = 4  # block size


def sched(policy: str = "fcfs", num_blocks: int = 64, queue_hints: int = 0,
          **cfg: Any) -> Scheduler:
    m = make_manager(full_spec(BS), num_blocks=num_blocks, max_model_len=256,
                     queue_hints=queue_hints)
    return Scheduler(m, SchedulerConfig(schedule_policy=policy, **cfg))


def add(s: Scheduler, rid: str, tokens: list[int], max_tokens: int = 1) -> Request:
    r = s.kv.make_request(rid, tokens, max_tokens=max_tokens, ignore_eos=True)
    s.add_request(r)
    return r


def step(s: Scheduler) -> list[str]:
    """One step; returns the ids admitted in it, in admission order."""
    out = s.schedule()
    s.update_from_output(out, {x.request_id: 1 for x in out.scheduled if x.samples})
    s.kv.check_invariants()
    return [x.request_id for x in out.scheduled if x.is_new]


def drain(s: Scheduler) -> None:
    for _ in range(1000):
        if not s.has_unfinished_requests():
            return
        step(s)
    raise AssertionError("did not finish")


P = list(range(100, 124))  # 6 blocks: the prefix cached by warm()


def warm(s: Scheduler) -> None:
    add(s, "warm", [*P, 1])
    drain(s)


def queue(s: Scheduler) -> None:
    add(s, "none", list(range(500, 525)))  # nothing cached
    add(s, "half", P[:12] + list(range(600, 613)))  # 3 blocks cached
    add(s, "full", [*P, 7])  # 6 blocks cached


@pytest.mark.parametrize(("policy", "expected"), [
    ("fcfs", ["none", "half", "full"]),
    ("lpm", ["full", "half", "none"]),
    ("dfs-weight", ["half", "full", "none"]),  # half and full share 3 blocks: a group of 2
])
def test_admission_order_by_cached_prefix(policy: str, expected: list[str]) -> None:
    s = sched(policy)
    warm(s)
    queue(s)
    assert step(s) == expected


def test_dfs_weight_groups_shared_prefixes_heaviest_first() -> None:
    s = sched("dfs-weight")
    x, y = list(range(200, 208)), list(range(300, 308))  # two 2-block prefixes, never cached
    for rid, prefix, tail in [("y1", y, 1), ("x1", x, 2), ("y2", y, 3), ("z", [9] * 8, 4),
                              ("x2", x, 5), ("x3", x, 6)]:
        add(s, rid, prefix + [tail] * 5)
    # x (3 requests) before y (2), y before z (1); within a group, arrival order.
    assert step(s) == ["x1", "x2", "x3", "y1", "y2", "z"]


def test_dfs_weight_order_on_paths() -> None:
    reqs = [Request(f"r{i}", [i]) for i in range(5)]
    paths = [["a", "b"], ["c"], ["a"], ["a", "d"], ["a", "b", "e"]]
    order = dfs_weight_order(reqs, paths)  # type: ignore[arg-type]  # str stands for a hash
    # Node a (4 requests): r2 ends there, then its heavier child b (r0, r4), then d (r3); c last.
    assert [r.request_id for r in order] == ["r2", "r0", "r4", "r3", "r1"]


def test_pinned_head_keeps_its_place() -> None:
    s = sched("lpm")
    warm(s)
    queue(s)
    waiting = deque(s.waiting)
    pre = s.kv.make_request("pre", list(range(700, 710)), max_tokens=1)
    pre.status = RequestStatus.PREEMPTED
    waiting.appendleft(pre)
    order: WaitingOrder[Request] = WaitingOrder(
        s.config, lambda r: s.kv.get_computed_blocks(r)[1], holds_place)
    order.reorder(waiting, 0)
    assert [r.request_id for r in waiting] == ["pre", "full", "half", "none"]


@pytest.mark.parametrize(("policy", "declared"), [("fcfs", "none"), ("lpm", "full")])
def test_queue_hints_follow_the_order(policy: str, declared: str) -> None:
    s = sched(policy, queue_hints=1, max_num_seqs=1)
    warm(s)
    add(s, "long", list(range(800, 840)), max_tokens=50)
    step(s)  # "long" runs and holds the only seat from now on
    queue(s)
    step(s)
    # What the scheduler last declared to the cache (count, last chained hash, skip flag).
    hashes = s.requests[declared].block_hashes
    assert s._declared == ((len(hashes), hashes[-1], False),)


def test_lpm_lookups_are_bounded_per_step() -> None:
    s = sched("lpm", max_num_seqs=1, lpm_lookups_per_step=2)
    add(s, "long", list(range(800, 840)), max_tokens=50)
    step(s)
    for i in range(6):
        add(s, f"w{i}", list(range(1000 + 40 * i, 1030 + 40 * i)))
    step(s)
    assert s._order.num_lookups == 2
    step(s)
    step(s)
    assert s._order.num_lookups == 6  # the stalest next: every request looked up once


@pytest.mark.parametrize("policy", ["fcfs", "lpm", "dfs-weight"])
def test_an_id_aborted_and_submitted_again_is_a_new_request(policy: str) -> None:
    """A waiting request aborted and submitted again under its id before the next step: the
    new request runs to completion, the aborted one is never scheduled (issue 45: dfs-weight
    kept the aborted object in its reorder cache, scheduled it, and lost the new one)."""
    s = sched(policy, max_num_seqs=1)
    add(s, "long", list(range(800, 840)), max_tokens=3)
    step(s)  # "long" holds the only seat for three steps
    old = add(s, "a", list(range(200, 230)))
    add(s, "b", list(range(300, 330)))
    step(s)  # both wait: the order has seen them
    s.abort_request("a")
    new = add(s, "a", list(range(400, 430)))
    admitted: list[str] = []
    for _ in range(20):
        out = s.schedule()
        assert all(s.requests.get(x.request_id) is x.request for x in out.scheduled)
        admitted += [x.request_id for x in out.scheduled if x.is_new]
        s.update_from_output(out, {x.request_id: 1 for x in out.scheduled if x.samples})
        if not s.has_unfinished_requests():
            break
    assert old.status is RequestStatus.FINISHED_ABORTED and old.num_output_tokens == 0
    assert new.status is RequestStatus.FINISHED_LENGTH and new.num_output_tokens == 1
    assert admitted == ["b", "a"]  # the new "a" arrived after "b"
    assert s.kv.num_free_blocks == 63


class _Waiting:
    """The fields an order reads of a request, nothing else."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.block_hashes: list[bytes] = []


def test_a_resubmitted_id_inherits_no_estimate_and_no_wait() -> None:
    """What an order remembers of a request (lpm's estimate, the wait behind the starvation
    bound) is never inherited by a later request with its id; the order is the same one vLLM's
    waiting queue uses (kvcore.integrations.vllm.queue)."""
    cfg = SchedulerConfig(schedule_policy="lpm", lpm_lookups_per_step=1, max_waiting_steps=2)
    a, b, c, a2 = _Waiting("a"), _Waiting("b"), _Waiting("c"), _Waiting("a")
    hits = {id(a): 100, id(b): 10, id(c): 10, id(a2): 0}
    order: WaitingOrder[_Waiting] = WaitingOrder(cfg, lambda r: hits[id(r)], lambda r: False)
    waiting = deque([a])
    order.reorder(waiting, 0)  # "a" waits from step 0 (its estimate: 100)
    waiting.extend([b, c])
    order.reorder(waiting, 2)
    assert list(waiting) == [a, b, c]
    waiting.remove(a)  # aborted ...
    waiting.append(a2)  # ... and a new request under its id
    order.reorder(waiting, 3)
    # Not starved ("a" waited from step 0, a2 from step 3) and not estimated at 100: looked up
    # first (never looked up), so last, behind the older equal estimates.
    assert list(waiting) == [b, c, a2]


@pytest.mark.parametrize("policy", ["lpm", "dfs-weight"])
def test_the_order_holds_the_queue_objects(policy: str) -> None:
    cfg = SchedulerConfig(schedule_policy=policy)
    order: WaitingOrder[_Waiting] = WaitingOrder(cfg, lambda r: 0, lambda r: False)
    a, b, a2 = _Waiting("a"), _Waiting("b"), _Waiting("a")
    waiting = deque([a, b])
    order.reorder(waiting, 0)
    waiting.remove(a)
    waiting.append(a2)
    order.reorder(waiting, 1)
    assert list(waiting) == [b, a2]


def _stream(policy: str, bound: int) -> int | None:
    """One request with nothing cached, then every step a new request that hits the cached
    prefix; one seat.  The step at which the lonely request is admitted (None: within 40)."""
    s = sched(policy, max_num_seqs=1, max_waiting_steps=bound)
    warm(s)
    add(s, "first", [*P, 50])
    add(s, "lonely", list(range(900, 930)))
    start = s.stats.steps
    for k in range(40):
        add(s, f"hit{k}", [*P, 60 + k])
        if "lonely" in step(s):
            return s.stats.steps - start
    return None


def test_starvation_bound() -> None:
    assert _stream("lpm", 10_000) is None  # without the guard, lpm starves it
    admitted = _stream("lpm", 5)
    # Waiting more than 5 steps puts it first; admitted in the step after that.
    assert admitted is not None and admitted <= 5 + 2
    dfs = _stream("dfs-weight", 5)
    assert dfs is not None and dfs <= 5 + 2


def test_config_names_bad_values() -> None:
    with pytest.raises(InvalidArgumentError, match="'sjf'"):
        SchedulerConfig(schedule_policy="sjf")
    with pytest.raises(InvalidArgumentError, match=r"max_waiting_steps.*0"):
        SchedulerConfig(schedule_policy="lpm", max_waiting_steps=0)
    with pytest.raises(InvalidArgumentError, match="lpm_lookups_per_step"):
        SchedulerConfig(lpm_lookups_per_step=-1)
    assert SchedulerConfig(schedule_policy="recommended").schedule_policy == RECOMMENDED


def test_replay_reports_ttft_and_refuses_belady_reordered() -> None:
    reqs = multi_turn(num_conversations=4, turns=3)
    r = replay(reqs, ReplayConfig(num_blocks=400, schedule_policy="dfs-weight"))
    assert r.num_finished == len(reqs)
    assert 0 < r.queue_ms_p50 <= r.ttft_ms_p50 <= r.ttft_ms_p99
    assert r.output_tokens_per_s > 0
    with pytest.raises(InvalidArgumentError, match=r"belady.*'lpm'"):
        replay(reqs, ReplayConfig(num_blocks=400, eviction_policy="belady",
                                  schedule_policy="lpm"))


def test_cli_json_names_the_schedule_policy(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["replay", "--workload", "multi-turn", "--num-blocks", "300",
                     "--schedule-policy", "lpm", "--json", "--no-progress"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["schedule_policy"] == "lpm"
    assert out["replay"]["ttft_ms_p99"] >= out["replay"]["ttft_ms_p50"] > 0
    assert "queue_ms_p50" in out["replay"] and "token_hit_rate" in out["replay"]
    with pytest.raises(SystemExit):
        cli_main(["replay", "--schedule-policy", "sjf"])


def test_study_divides_only_a_real_gap() -> None:
    assert gap_closed(0.30, 0.20, 0.40) == pytest.approx(0.5)
    assert gap_closed(0.15, 0.20, 0.40) == pytest.approx(-0.25)
    assert gap_closed(0.933, 0.933, 0.934) is None  # a tenth of a point: no share printed
    assert gap_closed(0.5, 0.5, 0.4) is None


def test_study_parses_the_order() -> None:
    assert parse_config("slru+64@lpm") == ("slru", 64, "lpm")
    assert parse_config("lru") == ("lru", 0, "fcfs")
    with pytest.raises(Exception, match="sjf"):
        parse_config("lru@sjf")


@pytest.mark.parametrize("policy", ["lpm", "dfs-weight"])
def test_reordered_replay_with_a_host_tier(policy: str) -> None:
    """The connector path (host tier loads as external tokens) under a non-FCFS order: every
    request finishes and the host tier serves hits."""
    reqs = multi_turn(num_conversations=8, turns=4)
    r = replay(reqs, ReplayConfig(num_blocks=120, host_blocks=2000, schedule_policy=policy,
                                  time_scale=0.1))
    assert r.num_finished == len(reqs)
    assert r.host_hit_tokens > 0
