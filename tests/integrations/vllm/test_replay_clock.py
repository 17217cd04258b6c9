"""The vLLM replay's simulated clock, engine names, offline bounds and starvation check
(kvcore.integrations.vllm.replay_clock / replay_engine / replay_oracle): TTFT and queueing on a
trace small enough to work out by hand, kvcore's LRU still vLLM's exact schedule with requests
arriving on the clock, the bounds built by the replay alone, and the guard's order checked."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import pytest

from kvcore.errors import InvalidArgumentError
from kvcore.eviction.offline import INFINITE
from kvcore.integrations.vllm.replay import (
    Engine,
    ReplaySetup,
    _make_requests,
    differences,
    main,
    make_scheduler,
    run,
)
from kvcore.integrations.vllm.replay_clock import STARVATION_SLACK, check_starvation
from kvcore.integrations.vllm.replay_oracle import OracleFeed
from kvcore.sim.clock import StepCost
from kvcore.sim.traces import TraceRequest
from kvcore.sim.workloads import make_workload


def _request(rid: str, arrival_ms: float, prompt_len: int, output_len: int, first: int
             ) -> TraceRequest:
    return TraceRequest(rid, arrival_ms, prompt_len, output_len,
                        prompt=tuple(range(first, first + prompt_len)))


def test_ttft_and_queueing_on_a_trace_worked_out_by_hand() -> None:
    """One seat, steps of 10 ms + 1 ms a token, arrivals at half their trace times.
    t=0: A (32 tokens) prefills, first token at 42.  t=42: B (arrived 2.5) waits for the seat;
    A decodes its second token (11 ms), done at 53.  t=53: B prefills (26 ms): first token at
    79.  Idle: the clock jumps to 500, where C and D arrive; C prefills (18 ms) to 518, D waits a
    step and prefills to 536."""
    trace = [_request("A", 0, 32, 2, 0), _request("B", 5, 16, 1, 100),
             _request("C", 1000, 8, 1, 200), _request("D", 1000, 8, 1, 300)]
    setup = ReplaySetup(block_size=16, num_blocks=64, max_model_len=256, max_num_seqs=1,
                        max_num_batched_tokens=64,
                        step_cost=StepCost(step_base_ms=10, step_ms_per_token=1, time_scale=0.5))
    ours = run(trace, setup, Engine.parse("kvcore"), record=True)
    assert ours.steps == 5 and ours.finished == 4
    # TTFT: A 42, B 79 - 2.5, C 18, D 36; queueing: A 0, B 53 - 2.5, C 0, D 18.
    assert ours.latency == pytest.approx({
        "ttft_ms_p50": 36.0, "ttft_ms_p99": 42.0,  # nearest rank below: 2nd and 3rd of 4
        "queue_ms_p50": 0.0, "queue_ms_p99": 18.0, "queue_ms_mean": (50.5 + 18) / 4,
        "sim_time_ms": 536.0, "max_wait_steps": 1})
    assert ours.wait_steps == {"A": 0, "B": 1, "C": 0, "D": 1}
    theirs = run(trace, setup, Engine.parse("vllm"), record=True)
    assert not differences(theirs, ours) and theirs.latency == ours.latency
    # time_scale 0: every request queued before the first step (the replay before its clock).
    at_once = run(trace, replace(setup, step_cost=StepCost(10, 1, 0)), Engine.parse("kvcore"))
    assert at_once.wait_steps == {"A": 0, "B": 2, "C": 3, "D": 4}
    assert at_once.latency["sim_time_ms"] == 42 + 11 + 26 + 18 + 18


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_lru_gives_vllms_exact_schedule_with_requests_on_the_clock(async_scheduling: bool
                                                                   ) -> None:
    """Arrivals spread over the run (a quarter of the trace times): the clock follows the
    schedule, so both managers see the same arrivals and the same times."""
    requests = make_workload("multi-turn", num_conversations=6, turns=4)
    setup = ReplaySetup(block_size=16, num_blocks=96, max_model_len=2048, max_num_seqs=12,
                        max_num_batched_tokens=256, async_scheduling=async_scheduling,
                        step_cost=StepCost(time_scale=0.25))
    theirs = run(requests, setup, Engine.parse("vllm"), record=True)
    ours = run(requests, setup, Engine.parse("kvcore"), record=True)
    assert not differences(theirs, ours), differences(theirs, ours)
    assert ours.latency == theirs.latency and ours.wait_steps == theirs.wait_steps
    assert theirs.finished == len(requests) and theirs.hits > 0
    latency = theirs.latency  # each request's first token comes after its first scheduling
    assert 0 < latency["queue_ms_p50"] <= latency["ttft_ms_p50"]
    assert latency["queue_ms_p99"] <= latency["ttft_ms_p99"]
    # The arrivals matter: queued at once, the same requests wait longer.
    at_once = run(requests, replace(setup, step_cost=StepCost(time_scale=0)), Engine.parse("vllm"))
    assert at_once.latency["max_wait_steps"] > theirs.latency["max_wait_steps"]


@pytest.mark.parametrize(("text", "policy", "schedule", "oracle", "lru"), [
    ("vllm", None, None, None, True),
    ("kvcore", "lru", "fcfs", None, True),
    ("kvcore@fcfs", "lru", "fcfs", None, True),
    ("kvcore@dfs-weight", "lru", "dfs-weight", None, False),
    ("kvcore:recommended@lpm", "learned", "lpm", None, False),
    ("kvcore:slru:protected_share=0.7@recommended", "slru:protected_share=0.7", "lpm", None,
     False),
    ("kvcore:belady", "lru", "fcfs", "belady", False),
    ("kvcore:reuse_oracle@fcfs", "lru", "fcfs", "reuse_oracle", False),
    ("kvcore:learned+hints=64@lpm", "learned", "lpm", None, False),
    ("kvcore:slru+hints=0", "slru", "fcfs", None, False),
])
def test_engine_names(text: str, policy: str | None, schedule: str | None, oracle: str | None,
                      lru: bool) -> None:
    engine = Engine.parse(f" {text} ", max_waiting_steps=7)
    assert (engine.name, engine.oracle, engine.lru) == (text, oracle, lru)
    settings = engine.settings
    if policy is None:
        assert settings is None
        return
    assert settings is not None
    assert (settings.eviction_policy, settings.schedule_policy) == (policy, schedule)
    assert settings.max_waiting_steps == 7
    assert engine.reorders == (schedule != "fcfs")
    if "+hints=" in text:
        assert settings.queue_hints == int(text.split("+hints=")[1].split("@")[0])


@pytest.mark.parametrize(("text", "match"), [
    ("sglang", "unknown engine 'sglang'"),
    ("kvcore:", "unknown engine"),
    ("kvcore@", "unknown engine"),
    ("vllm@lpm", "vLLM's own manager runs vLLM's queue"),
    ("kvcore@sjf", "engine 'kvcore@sjf': .*unknown schedule_policy 'sjf'"),
    ("kvcore:mru", "unknown eviction policy 'mru'"),
    ("kvcore:fifo", "simulator-only"),
    ("kvcore:belady@lpm", "belady is a bound for arrival order.*not 'lpm'"),
    ("kvcore:reuse_oracle:x=1", "reuse_oracle takes no options"),
    ("kvcore:learned+hints=many", r"\+hints= takes a count, got 'many'"),
])
def test_bad_engine_names_are_refused_naming_them(text: str, match: str) -> None:
    with pytest.raises(InvalidArgumentError, match=match):
        Engine.parse(text)


def test_the_command_line_refuses_bad_engines_and_step_costs(
        capsys: pytest.CaptureFixture[str]) -> None:
    for argv, match in ((["--engines", "kvcore@sjf"], "unknown schedule_policy 'sjf'"),
                        (["--max-waiting-steps", "0"], "max_waiting_steps"),
                        (["--time-scale", "nan"], "time_scale must be a finite number"),
                        (["--engines", "kvcore:belady", "--hybrid"], "one KV-cache group")):
        with pytest.raises(SystemExit):
            main(["shared-prefix", *argv])
        assert match in capsys.readouterr().err


def test_the_offline_bounds_are_refused_by_vllms_configuration() -> None:
    setup = ReplaySetup(block_size=16, num_blocks=64, max_model_len=256)
    for policy in ("belady", "reuse_oracle"):
        with pytest.raises(InvalidArgumentError, match=f"'{policy}' is simulator-only"):
            make_scheduler(setup, Engine.parse("kvcore"),
                           additional_config={"kvcore": {"eviction_policy": policy}})


def test_the_offline_bound_learns_vllms_hashes_in_the_pools_key_space() -> None:
    """The pool caches blocks under vLLM's request hashes: what the bound was taught."""
    requests = make_workload("shared-prefix", num_groups=2, prompts_per_group=3, system_len=64)
    setup = ReplaySetup(block_size=16, num_blocks=64, max_model_len=512)
    sched = make_scheduler(setup, Engine.parse("kvcore:belady"))
    made = [req for _, req in _make_requests(requests, setup, sched.hash_block_size)]
    feed = OracleFeed(sched, made)
    for req in made:
        sched.add_request(req)
    so = sched.schedule()
    pool = sched.kv_cache_manager.kv.pool
    cached = {b.block_hash for b in pool.blocks if b.block_hash is not None}
    taught = cached & set(feed.policy.uses)
    # A system prompt's blocks: every request of its group can hit them.
    assert taught and max(len(feed.policy.uses[h]) for h in taught) == 3
    assert all(feed.policy.next_use(h) != INFINITE for h in taught)
    first = [r.req_id for r in so.scheduled_new_reqs]
    feed.scheduled(first)
    assert feed.policy.now == max(feed.index[rid] for rid in first) + 1
    with pytest.raises(InvalidArgumentError, match="not an offline bound"):
        OracleFeed(make_scheduler(setup, Engine.parse("kvcore")), made)


@pytest.mark.parametrize("workload", ["multi-turn", "few-shot"])
def test_the_offline_bounds_run_inside_vllms_scheduler(workload: str) -> None:
    """Measured, not implied: inside vLLM's admission a better cache can change the schedule,
    so Belady is no proven bound here; on these workloads it is, and the reuse oracle between."""
    requests = (make_workload("multi-turn", num_conversations=6, turns=4)
                if workload == "multi-turn" else make_workload("few-shot", num_requests=40))
    setup = ReplaySetup(block_size=16, num_blocks=96, max_model_len=2048, max_num_seqs=12,
                        max_num_batched_tokens=256)
    rates = {}
    for name in ("kvcore", "kvcore:reuse_oracle", "kvcore:belady"):
        r = run(requests, setup, Engine.parse(name))
        assert r.finished == len(requests)
        rates[name] = r.hit_rate
    assert rates["kvcore"] < rates["kvcore:reuse_oracle"] < rates["kvcore:belady"]


def test_the_starvation_check_holds_the_guards_order() -> None:
    bound = 4
    past = bound + STARVATION_SLACK + 1  # a wait the check holds to the order
    order = ["a", "b", "c"]
    # In arrival order, or ahead of an older request only within the bound and its slack.
    check_starvation("e", order, {"a": past, "b": past, "c": 0}, {"a": 10, "b": 10, "c": 3}, bound)
    check_starvation("e", order, {"a": past, "b": bound + STARVATION_SLACK, "c": 0},
                     {"a": 12, "b": 10, "c": 11}, bound)
    with pytest.raises(RuntimeError, match=r"e: starvation guard broken: request 'a' .* step "
                                           r"12, while 'c', .* at step 11"):
        check_starvation("e", order, {"a": past, "b": 0, "c": past}, {"a": 12, "b": 2, "c": 11},
                         bound)


def test_the_report_has_the_clock_and_the_wait_in_steps(capsys: pytest.CaptureFixture[str]
                                                        ) -> None:
    """A non-FCFS engine is run with its guard checked and not compared with vLLM's schedule."""
    assert main(["few-shot", "--max-requests", "20", "--num-blocks", "64", "--repeats", "0",
                 "--engines", "vllm,kvcore,kvcore@lpm", "--max-waiting-steps", "3",
                 "--time-scale", "0.5", "--json"]) == 0
    out: dict[str, Any] = json.loads(capsys.readouterr().out)
    rows = {r["engine"]: r for r in out["results"]}
    assert out["setup"]["step_cost"] == {"step_base_ms": 5.0, "step_ms_per_token": 0.02,
                                         "time_scale": 0.5}
    assert rows["kvcore"]["identical_to_vllm"] is True
    assert rows["kvcore@lpm"]["identical_to_vllm"] is None
    for row in rows.values():
        assert row["finished"] == 20 and row["max_wait_steps"] >= 0
        assert 0 < row["ttft_ms_p50"] <= row["ttft_ms_p99"]
        assert 0 <= row["queue_ms_p50"] <= row["queue_ms_p99"]
    assert rows["kvcore"]["ttft_ms_p99"] == rows["vllm"]["ttft_ms_p99"]
