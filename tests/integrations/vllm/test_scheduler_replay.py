"""vLLM's real Scheduler / AsyncScheduler, no model (kvcore.integrations.vllm.replay): with
kvcore's LRU manager it makes exactly vLLM's schedule (tokens per request, preemptions, new block
ids, step by step), the same prefix-cache stats and byte-identical KV-event batches; with other
policies and invariant checks after every step every request still finishes.  Also: the general
plugin's route, the KV-connector paths, and the refusals that need the whole vLLM config."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from kvcore.errors import UnsupportedFeatureError
from kvcore.integrations.vllm.replay import Engine, ReplaySetup, differences, make_scheduler, run
from kvcore.integrations.vllm.settings import parse_settings
from kvcore.sim.traces import TraceRequest
from kvcore.sim.workloads import make_workload
from tests.integrations.vllm.helpers import full, kv_config, swa

VLLM = Engine.parse("vllm")
KVCORE = Engine.parse("kvcore")

WORKLOADS = {
    "shared-prefix": lambda: make_workload("shared-prefix", num_groups=4, prompts_per_group=8,
                                           system_len=256),
    "multi-turn": lambda: make_workload("multi-turn", num_conversations=6, turns=4),
    "few-shot": lambda: make_workload("few-shot", num_requests=40),
    "random": lambda: make_workload("random", num_requests=40, max_len=400),
}


def _setup(**kwargs: Any) -> ReplaySetup:
    base = ReplaySetup(block_size=16, num_blocks=96, max_model_len=2048, max_num_seqs=12,
                       max_num_batched_tokens=256)
    return replace(base, **kwargs)


def _same(requests: list[TraceRequest], setup: ReplaySetup, engine: Engine = KVCORE
          ) -> tuple[Any, Any]:
    theirs = run(requests, setup, VLLM, record=True)
    ours = run(requests, setup, engine, record=True)
    assert not differences(theirs, ours), differences(theirs, ours)
    assert ours.finished == theirs.finished == len(requests)
    return theirs, ours


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("workload", sorted(WORKLOADS))
def test_lru_gives_vllms_exact_schedule_stats_and_events(workload: str,
                                                         async_scheduling: bool) -> None:
    requests = WORKLOADS[workload]()
    theirs, _ = _same(requests, _setup(async_scheduling=async_scheduling))
    assert theirs.event_batches and theirs.steps > 20
    if workload == "shared-prefix":
        assert theirs.hits > 0 and theirs.preemptions > 0  # the cache was small enough to matter


@pytest.mark.parametrize("retention", [0, None, 128], ids=["sparse", "dense", "every-128"])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_hybrid_sliding_window_gives_vllms_exact_schedule(async_scheduling: bool,
                                                          retention: int | None) -> None:
    """Full + sliding-window groups under vLLM's retention settings (0, its default: window
    tails only where a later request can resume; None: every block a hit can end on): window
    blocks leave on vLLM's processed-token boundary, also with a step in flight."""
    setup = _setup(kv_cache_groups=lambda: kv_config(full(), swa(48)).kv_cache_groups,
                   prefix_cache_retention_interval=retention, async_scheduling=async_scheduling,
                   num_blocks=160)
    theirs, _ = _same(WORKLOADS["shared-prefix"](), setup)
    assert theirs.hits > 0


def test_a_sliding_window_only_model_gives_vllms_exact_schedule() -> None:
    setup = _setup(kv_cache_groups=lambda: kv_config(swa(64)).kv_cache_groups)
    theirs, _ = _same(WORKLOADS["multi-turn"](), setup)
    assert theirs.steps > 20


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("workload", ["shared-prefix", "multi-turn"])
def test_watermark_metrics_and_prompt_embeds_give_vllms_exact_schedule(
        workload: str, async_scheduling: bool) -> None:
    """vLLM's admission watermark (10% of the pool), its KV-cache residency metrics (every
    block sampled: the tracked blocks with their access counts and the eviction records, step by
    step) and requests with prompt embeddings (their digests in the events' extra keys)."""
    setup = _setup(watermark=0.1, kv_cache_metrics=True, prompt_embeds=True,
                   async_scheduling=async_scheduling)
    theirs, _ = _same(WORKLOADS[workload](), setup)
    assert theirs.metrics and any(gaps for _, gaps in theirs.metrics)
    assert b"prompt" not in b"".join(theirs.event_batches)  # untagged, as vLLM publishes them
    if workload == "shared-prefix":
        assert theirs.hits > 0 and theirs.preemptions > 0
    # The watermark changes vLLM's schedule, and kvcore's with it.
    plain = run(WORKLOADS[workload](), replace(setup, watermark=0.0), VLLM, record=True)
    assert plain.schedule != theirs.schedule


@pytest.mark.parametrize("policy", ["recommended", "slru", "s3fifo", "arc", "learned"])
def test_other_policies_finish_everything_with_invariants_checked_every_step(policy: str) -> None:
    engine = Engine(f"kvcore:{policy}", parse_settings(
        {"eviction_policy": policy, "check_invariants_every": 1}))
    requests = WORKLOADS["shared-prefix"]()
    ours = run(requests, _setup(), engine)
    assert ours.finished == len(requests) and ours.hits > 0


def test_recommended_on_the_async_scheduler_with_hints() -> None:
    engine = Engine("kvcore:recommended", parse_settings(
        {"eviction_policy": "recommended", "check_invariants_every": 1}))
    assert engine.settings is not None and engine.settings.queue_hints == 128
    requests = WORKLOADS["multi-turn"]()
    assert run(requests, _setup(async_scheduling=True), engine).finished == len(requests)


CONNECTOR = {"kv_connector": "ExternalPrefixConnector", "kv_role": "kv_both",
             "kv_connector_module_path": "tests.integrations.vllm.fake_connectors"}


def _connector_requests() -> list[TraceRequest]:
    out = []
    for i, base in enumerate(make_workload("random", num_requests=24, max_len=300)):
        prefix = ("ext", "async", "local")[i % 3]
        out.append(replace(base, request_id=f"{prefix}-{i}"))
    return out


def test_connector_paths_give_vllms_exact_schedule() -> None:
    """External hits, synchronous and asynchronous loads (blocks allocated with delayed caching,
    cached once the load reports back), connector bookkeeping on finish."""
    setup = _setup(kv_transfer_config=CONNECTOR, num_blocks=64)
    theirs, _ = _same(_connector_requests(), setup)
    assert theirs.finished == 24 and theirs.event_batches


def test_the_connector_sees_the_same_calls() -> None:
    setup = _setup(kv_transfer_config=CONNECTOR, num_blocks=64)
    seen = []
    for engine in (VLLM, KVCORE):
        sched = make_scheduler(setup, engine)
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        from tests.integrations.vllm.helpers import hasher

        for r in _connector_requests()[:6]:
            sched.add_request(Request(r.request_id, r.prompt_token_ids(),
                                      SamplingParams(max_tokens=2, ignore_eos=True), None,
                                      block_hasher=hasher()))
        sched.schedule()
        seen.append(list(sched.connector.allocations))
    assert seen[0] == seen[1] and any(n for _, n in seen[0])


def test_a_connector_asking_for_divergent_hybrid_hits_is_accepted() -> None:
    """NixlConnector's flag: the per-group lookup is the plain one for every model kvcore
    accepts, so the schedule is vLLM's (sync and async loads)."""
    setup = _setup(kv_transfer_config={**CONNECTOR, "kv_connector": "DivergentHitsConnector"},
                   num_blocks=64)
    theirs, _ = _same(_connector_requests(), setup)
    assert theirs.finished == 24 and theirs.event_batches


def test_a_connector_that_reads_vllms_pool_is_refused() -> None:
    setup = _setup(kv_transfer_config={**CONNECTOR, "kv_connector": "PoolReadingConnector"})
    with pytest.raises(UnsupportedFeatureError, match="PoolReadingConnector"):
        make_scheduler(setup, KVCORE)
    make_scheduler(setup, VLLM)  # vLLM's own manager takes it


@pytest.mark.parametrize("workload", ["shared-prefix", "multi-turn"])
def test_deferred_frees_give_vllms_exact_schedule(workload: str) -> None:
    """vLLM's deferred block frees (a KV consumer with overlapped steps: P/D decode instances,
    CPU offloading): a finished or preempted request's blocks return to the pool only once the
    step that may still write them was processed; meanwhile they count as used (admission and
    preemption see fewer free blocks).  Forced on as vLLM's own tests force it."""
    setup = _setup(async_scheduling=True, defer_block_free=True, stop_by_token=True)
    theirs, ours = _same(WORKLOADS[workload](), setup)
    assert theirs.steps > 20 and theirs.event_batches
    assert ours.max_deferred_frees == theirs.max_deferred_frees > 0
    if workload == "shared-prefix":
        assert theirs.preemptions > 0


def test_the_plugin_route_mixes_kvcore_into_the_class_vllm_picks() -> None:
    from vllm.config import SchedulerConfig
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler

    from kvcore.integrations.vllm import KvcoreSchedulerMixin
    from kvcore.integrations.vllm.plugin import register

    original = SchedulerConfig.get_scheduler_cls
    try:
        register()
        register()  # idempotent: vLLM loads plugins in every process, maybe more than once
        wrapped = SchedulerConfig.get_scheduler_cls
        assert getattr(wrapped, "_kvcore_wrapped", False) and wrapped.__wrapped__ is original
        for async_scheduling, base in ((False, Scheduler), (True, AsyncScheduler)):
            config = SchedulerConfig.default_factory(async_scheduling=async_scheduling)
            cls = config.get_scheduler_cls()
            assert issubclass(cls, base) and issubclass(cls, KvcoreSchedulerMixin)
            assert cls.kvcore_required is False
        # Opted in (additional_config has "kvcore"): kvcore's manager; otherwise vLLM's own.
        from kvcore.integrations.vllm.manager import KVCacheManagerAdapter

        cls = SchedulerConfig.default_factory().get_scheduler_cls()
        opted = make_scheduler(_setup(), KVCORE, scheduler_cls=cls)
        plain = make_scheduler(_setup(), VLLM, scheduler_cls=cls)
        assert isinstance(opted.kv_cache_manager, KVCacheManagerAdapter)
        assert not isinstance(plain.kv_cache_manager, KVCacheManagerAdapter)
        # vLLM's module name is restored after every construction.
        from vllm.v1.core.kv_cache_manager import KVCacheManager
        from vllm.v1.core.sched import scheduler as module

        assert module.KVCacheManager is KVCacheManager
    finally:
        SchedulerConfig.get_scheduler_cls = original


def test_a_refusal_leaves_vllms_module_name_restored() -> None:
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.sched import scheduler as module

    setup = _setup(kv_transfer_config={**CONNECTOR, "kv_connector": "PoolReadingConnector"})
    with pytest.raises(UnsupportedFeatureError):
        make_scheduler(setup, KVCORE)
    assert module.KVCacheManager is KVCacheManager


def test_the_comparison_sees_a_different_eviction_order() -> None:
    """Not vacuous: SLRU evicts differently, and the recorded runs say where."""
    requests = WORKLOADS["shared-prefix"]()
    theirs = run(requests, _setup(), VLLM, record=True)
    ours = run(requests, _setup(), Engine.parse("kvcore:slru"), record=True)
    assert any("event_batches" in d for d in differences(theirs, ours))


@pytest.mark.parametrize(("raw", "match"), [
    ({"eviction_policy": "mru"}, "unknown eviction policy 'mru'"),
    ({"queue_hint": 8}, "unknown additional_config"),
    ({"check_invariants_every": -1}, "check_invariants_every"),
])
def test_bad_settings_stop_the_scheduler_at_start(raw: dict[str, Any], match: str) -> None:
    from kvcore.errors import InvalidArgumentError

    with pytest.raises(InvalidArgumentError, match=match):
        make_scheduler(_setup(), KVCORE, additional_config={"kvcore": raw})
