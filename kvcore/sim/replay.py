"""Replay a trace through the real :class:`~kvcore.scheduler.Scheduler` and
:class:`~kvcore.manager.KVCacheManager`, without a model.

Time is simulated: requests arrive at their trace timestamps (times ``time_scale``), and each
step advances the clock by ``step_base_ms + step_ms_per_token * batched_tokens``, a simple cost
model of a GPU step.  Generated tokens are deterministic pseudo-random ids, and each request
generates exactly its trace output length (``ignore_eos``).  The replay reports prefix-cache hit
rates (first admissions only, as vLLM counts them), evictions, preemptions, KV usage over time
and the scheduler + manager CPU time per step; and, from the simulated clock, per-request time to
first token (arrival to the end of the step that samples its first token), queueing delay
(arrival to admission) and output throughput.
"""

from __future__ import annotations

import numbers
import statistics
import sys
import time
import zlib
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from kvcore.connector import KVConnectorRole, OffloadingConnector
from kvcore.errors import InvalidArgumentError
from kvcore.events import KVCacheEvent
from kvcore.manager import KVCacheManager
from kvcore.request import Request
from kvcore.scheduler import RequestRejectedError, Scheduler, SchedulerConfig, SchedulerOutput
from kvcore.scheduler.admission import resolve as resolve_schedule_policy
from kvcore.settings import CacheSettings
from kvcore.sim.clock import (
    STEP_BASE_MS,
    STEP_MS_PER_TOKEN,
    TIME_SCALE,
    StepCost,
    check_arrivals,
    latency_summary,
    quantile,
)
from kvcore.sim.oracle import REPLAY_ORACLES, ReplayBelady
from kvcore.sim.traces import TraceRequest
from kvcore.specs import FullAttentionSpec, KVCacheConfig, KVCacheGroup
from kvcore.types import BlockHash, KVCacheBlock

VOCAB = 32_000


@dataclass
class ReplayConfig:
    """Cache size (``num_blocks`` or ``capacity_tokens``), scheduler limits and time model."""

    block_size: int = 16
    num_blocks: int | None = None
    capacity_tokens: int | None = None
    kv_config: KVCacheConfig | None = None  # overrides block_size/num_blocks (e.g. hybrid)
    max_model_len: int | None = None  # default: the longest request in the trace
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 8192
    # The cache's settings (made into one CacheSettings by cache_settings):
    enable_caching: bool = True
    hash_algo: str = "xxh3_128"
    eviction_policy: str = "lru"  # the real pool's policy (kvcore.eviction), or an oracle
    queue_hints: int = 0  # waiting requests the scheduler declares upcoming each step
    retain_sessions: bool = False  # SchedulerConfig.retain_sessions (the retention hint)
    schedule_policy: str = "fcfs"  # SchedulerConfig.schedule_policy (kvcore.scheduler.admission)
    max_waiting_steps: int = 256  # its starvation guard
    host_blocks: int = 0  # a host-memory tier of this many blocks behind the device cache
    host_eviction_policy: str = "lru"  # its eviction policy (kvcore.eviction names)
    host_admit_after: int = 1  # store a block in it on its N-th offer
    # The simulated clock (kvcore.sim.clock, shared with the replay inside vLLM's scheduler):
    step_base_ms: float = STEP_BASE_MS
    step_ms_per_token: float = STEP_MS_PER_TOKEN
    time_scale: float = TIME_SCALE
    progress: bool = False

    def step_cost(self) -> StepCost:
        """The clock's cost model (validated: a NaN or negative field raises here)."""
        return StepCost(self.step_base_ms, self.step_ms_per_token, self.time_scale)

    def cache_settings(self, enable_events: bool = False) -> CacheSettings:
        """The replay's :class:`CacheSettings` (validated: a bad policy raises here); the offline
        policies ``belady`` and ``reuse_oracle`` are :data:`~kvcore.sim.oracle.REPLAY_ORACLES`,
        which read the trace."""
        policy: object = self.eviction_policy
        oracle = REPLAY_ORACLES.get(self.eviction_policy)
        if oracle is not None:
            if self.kv_config is not None:
                raise InvalidArgumentError(
                    f"the {self.eviction_policy} oracle replays single-group caches only")
            policy = oracle
        return CacheSettings(enable_caching=self.enable_caching, hash_algo=self.hash_algo,
                             eviction_policy=policy,  # type: ignore[arg-type]  # str or factory
                             queue_hints=self.queue_hints, enable_events=enable_events)

    def resolve_num_blocks(self) -> int:
        if self.num_blocks is not None and self.capacity_tokens is not None:
            raise InvalidArgumentError("give num_blocks or capacity_tokens, not both")
        if self.num_blocks is not None:
            n = self.num_blocks
        elif self.capacity_tokens is not None:
            if self.capacity_tokens <= 0:
                raise InvalidArgumentError(f"capacity must be positive, got {self.capacity_tokens}")
            n = self.capacity_tokens // self.block_size + 1
        else:
            n = 4096
        if n < 2:
            raise InvalidArgumentError(f"a cache of {n} blocks is too small (need >= 2)")
        return n


@dataclass
class ReplayResult:
    num_requests: int
    num_finished: int
    num_rejected: int
    steps: int
    prompt_tokens: int
    hit_tokens: int
    token_hit_rate: float
    host_hit_tokens: int  # prompt tokens loaded from the host tier (beyond the device hit)
    host_hit_rate: float
    evicted_blocks: int
    preemptions: int
    sim_time_ms: float
    cpu_s: float
    cpu_us_per_step_median: float
    cpu_us_per_step_p99: float
    wall_s: float
    ttft_ms_p50: float = 0.0  # simulated clock: arrival -> end of the first sampling step
    ttft_ms_p99: float = 0.0
    queue_ms_p50: float = 0.0  # arrival -> admission (first time)
    queue_ms_p99: float = 0.0
    queue_ms_mean: float = 0.0
    output_tokens_per_s: float = 0.0  # sampled tokens / simulated time
    usage: list[tuple[float, float]] = field(default_factory=list)  # (sim time ms, usage)
    interrupted: bool = False  # stopped early (should_stop): the counts cover the steps run

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self) -> str:
        return (f"{self.num_finished}/{self.num_requests} requests ({self.num_rejected} rejected) "
                f"in {self.steps} steps; token hit rate {self.token_hit_rate:.2%}; "
                f"{self.evicted_blocks} evicted blocks; {self.preemptions} preemptions; "
                f"scheduler+manager {self.cpu_us_per_step_median:.1f} µs/step (median)")


def sampled_token(rid: str, n: int) -> int:
    x = (zlib.crc32(rid.encode()) * 6364136223846793005 + n * 1442695040888963407) & (2**64 - 1)
    return (x >> 33) % VOCAB


def make_manager(cfg: ReplayConfig, requests: Sequence[TraceRequest],
                 enable_events: bool = False,
                 built_oracles: list[ReplayBelady] | None = None) -> KVCacheManager:
    """The replay's manager; an offline bound its pool builds is appended to ``built_oracles``."""
    max_len = cfg.max_model_len or max(r.num_prompt_tokens + r.output_len for r in requests) + 1
    settings = cfg.cache_settings(enable_events)
    oracle_cls = REPLAY_ORACLES.get(cfg.eviction_policy)
    if oracle_cls is not None and built_oracles is not None:
        def build(blocks: Sequence[KVCacheBlock]) -> ReplayBelady:
            policy = oracle_cls(blocks)
            built_oracles.append(policy)
            return policy

        settings = settings.replace(eviction_policy=build)
    if cfg.kv_config is not None:
        kv_config = cfg.kv_config
    else:
        spec = FullAttentionSpec(block_size=cfg.block_size, num_kv_heads=1, head_size=1,
                                 dtype=torch.float16)
        kv_config = KVCacheConfig(cfg.resolve_num_blocks(), (KVCacheGroup(("model",), spec),))
    return KVCacheManager(kv_config, max_len, max_num_batched_tokens=cfg.max_num_batched_tokens,
                          settings=settings)


def make_scheduler(manager: KVCacheManager, cfg: ReplayConfig) -> Scheduler:
    """The replay's scheduler; with ``cfg.host_blocks`` it has an offloading connector (a host
    tier) whose worker side is :class:`SimulatedWorker`."""
    connector = None
    if cfg.host_blocks:
        connector = OffloadingConnector(KVConnectorRole.SCHEDULER, manager.config,
                                        num_host_blocks=cfg.host_blocks,
                                        eviction_policy=cfg.host_eviction_policy,
                                        admit_after=cfg.host_admit_after)
    return Scheduler(manager, SchedulerConfig(max_num_seqs=cfg.max_num_seqs,
                                              max_num_batched_tokens=cfg.max_num_batched_tokens,
                                              retain_sessions=cfg.retain_sessions,
                                              schedule_policy=cfg.schedule_policy,
                                              max_waiting_steps=cfg.max_waiting_steps),
                     connector)


class SimulatedStep:
    """One engine step without a model: schedule, run the worker-side connector (transfers
    complete at once, :class:`~kvcore.connector.InstantTransfer`), sample pseudo-random tokens,
    report back; then hand the step's KV events (device and host tier) to ``event_sink``."""

    def __init__(self, sched: Scheduler,
                 event_sink: Callable[[list[KVCacheEvent]], object] | None = None) -> None:
        self.sched = sched
        self.event_sink = event_sink
        self.worker = (OffloadingConnector(KVConnectorRole.WORKER)
                       if sched.connector is not None else None)

    def __call__(self, on_scheduled: Callable[[SchedulerOutput], object] | None = None
                 ) -> tuple[SchedulerOutput, list[Request]]:
        """Run one step (``on_scheduled`` sees the output before the engine reports back);
        returns it and the requests that finished."""
        sched = self.sched
        out = sched.schedule()
        if on_scheduled is not None:
            on_scheduled(out)
        conn_out = None
        if self.worker is not None and out.kv_connector_metadata is not None:
            worker = self.worker
            worker.bind_connector_metadata(out.kv_connector_metadata)
            worker.start_load_kv()
            worker.wait_for_save()
            conn_out = worker.connector_output(set(out.finished_request_ids))
            worker.clear_connector_metadata()
        sampled = {s.request_id: sampled_token(s.request_id, s.request.num_output_tokens)
                   for s in out.scheduled if s.samples}
        done = sched.update_from_output(out, sampled, conn_out)
        if self.event_sink is not None:
            self.event_sink(sched.take_events())
        return out, done


def check_inputs(requests: Sequence[TraceRequest], cfg: ReplayConfig) -> None:
    """Refuse what would make the simulated clock stall (a NaN, infinite or negative arrival
    time or time parameter: the replay would loop forever) and negative lengths."""
    cfg.step_cost()
    check_arrivals(requests)
    for r in requests:
        for name in ("num_prompt_tokens", "output_len"):
            value = getattr(r, name)
            if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 0:
                raise InvalidArgumentError(
                    f"request {r.request_id}: {name} must be an integer >= 0, got {value!r}")


def replay(requests: Sequence[TraceRequest], cfg: ReplayConfig | None = None, *,
           event_sink: Callable[[list[KVCacheEvent]], object] | None = None,
           should_stop: Callable[[], bool] | None = None) -> ReplayResult:
    """Run ``requests`` (in any order: they are sorted by arrival) to completion; see the module
    docstring.  ``event_sink`` (e.g. ``ZmqEventPublisher.publish``) receives the manager's KV
    events after every step.  ``should_stop`` is asked before every step: when it returns true
    the replay ends there, with the result of the steps run so far (``interrupted``).  Raises
    :class:`InvalidArgumentError` before running if an arrival time is NaN, infinite or
    negative, or a length is negative.  A prompt at or over the model length is counted as
    rejected without its tokens ever being made."""
    cfg = cfg or ReplayConfig()
    if not requests:
        raise InvalidArgumentError("the trace has no requests")
    check_inputs(requests, cfg)
    if cfg.eviction_policy in REPLAY_ORACLES and resolve_schedule_policy(
            cfg.schedule_policy) != "fcfs":
        raise InvalidArgumentError(f"{cfg.eviction_policy} is a bound for arrival order: replay "
                                   f"it with schedule_policy fcfs, not {cfg.schedule_policy!r}")
    run = _Run(requests, cfg, event_sink)
    interrupted = False
    while run.unfinished():
        if should_stop is not None and should_stop():
            interrupted = True
            break
        run.hand_over_arrivals()
        run.step()
    return run.result(interrupted)


class _Run:
    """One replay's state on the simulated clock: the trace not yet arrived, the requests that
    arrived but wait outside the scheduler, the manager and scheduler, and what is measured."""

    def __init__(self, requests: Sequence[TraceRequest], cfg: ReplayConfig,
                 event_sink: Callable[[list[KVCacheEvent]], object] | None) -> None:
        self.num_requests = len(requests)
        self.cost = cfg.step_cost()
        built: list[ReplayBelady] = []  # the offline bound the pool builds, if it runs one
        self.manager = manager = make_manager(cfg, requests, enable_events=event_sink is not None,
                                              built_oracles=built)
        order = sorted(requests, key=lambda r: r.arrival_ms)
        self.oracle = built[0] if built else None
        self.made: dict[str, Request] = {}  # the oracle's requests, made (and hashed) up front
        self.index: dict[str, int] = {}
        if self.oracle is not None:
            self.made, self.index = _teach_oracle(self.oracle, manager, order)
        self.sched = make_scheduler(manager, cfg)
        self.run_step = SimulatedStep(self.sched, event_sink)
        self.arrival = {r.request_id: self.cost.arrival(r.arrival_ms) for r in order}
        self.admitted: dict[str, float] = {}  # request id -> simulated time of first admission
        self.first_token: dict[str, float] = {}
        self.pending = deque(order)
        self.arrived: deque[TraceRequest] = deque()
        # Requests handed to the scheduler ahead of admission (at least as many as it may hint).
        self.window = max(2 * cfg.max_num_seqs, cfg.queue_hints)
        self.bar = progress_bar(len(requests)) if cfg.progress else None
        self.clock = 0.0
        self.cpu: list[float] = []
        self.usage: list[tuple[float, float]] = []
        self.rejected = self.finished = self.prompt_tokens = self.output_tokens = 0
        self.wall0 = time.perf_counter()

    def unfinished(self) -> bool:
        return bool(self.pending or self.arrived or self.sched.has_unfinished_requests())

    def hand_over_arrivals(self) -> None:
        """Move the requests that arrived by now to the scheduler, up to its window."""
        pending, arrived, sched = self.pending, self.arrived, self.sched
        while pending and self.cost.arrival(pending[0].arrival_ms) <= self.clock:
            arrived.append(pending.popleft())
        while arrived and sched.num_waiting < self.window:
            tr = arrived.popleft()
            if tr.num_prompt_tokens >= self.manager.max_model_len:
                # The scheduler would reject it: never make its tokens (they may not fit in
                # memory: a hash-id prompt can claim any length).
                self._reject()
                continue
            req = self.made.pop(tr.request_id, None) or make_request(self.manager, tr)
            try:
                sched.add_request(req)
                self.prompt_tokens += tr.num_prompt_tokens
            except RequestRejectedError:
                self._reject()

    def _reject(self) -> None:
        self.rejected += 1
        if self.bar is not None:
            self.bar.update(1)

    def step(self) -> None:
        """One engine step, or, with nothing to run, the clock moved to the next arrival."""
        if not self.sched.has_unfinished_requests():
            if self.pending:
                self.clock = max(self.clock, self.cost.arrival(self.pending[0].arrival_ms))
            return
        t0 = time.perf_counter()
        out, done = self.run_step(self._admitted)
        self.cpu.append(time.perf_counter() - t0)
        self.clock += self.cost.step_ms(out.num_batched_tokens)
        for s in out.scheduled:
            if s.samples:
                self.output_tokens += 1
                self.first_token.setdefault(s.request_id, self.clock)
        self.usage.append((self.clock, self.manager.usage))
        self.finished += len(done)
        if self.bar is not None and done:
            self.bar.update(len(done))

    def _admitted(self, out: SchedulerOutput) -> None:
        """Note first admissions (the offline bound learns who was admitted)."""
        for s in out.scheduled:
            if s.is_new:
                self.admitted.setdefault(s.request_id, self.clock)
                if self.oracle is not None:
                    self.oracle.advance(self.index[s.request_id], s.request.block_hashes)

    def result(self, interrupted: bool) -> ReplayResult:
        if self.bar is not None:
            self.bar.close()
        manager, sched, cpu = self.manager, self.sched, self.cpu
        stats = manager.make_prefix_cache_stats()
        hits = stats.hits if stats else 0
        queries = stats.queries if stats else 0
        external = sched.stats.external_hit_tokens
        return ReplayResult(
            num_requests=self.num_requests, num_finished=self.finished,
            num_rejected=self.rejected, steps=sched.stats.steps,
            prompt_tokens=self.prompt_tokens, hit_tokens=hits,
            token_hit_rate=hits / queries if queries else 0.0,
            host_hit_tokens=external, host_hit_rate=external / queries if queries else 0.0,
            evicted_blocks=manager.pool.num_evicted_blocks,
            preemptions=sched.stats.num_preemptions, sim_time_ms=self.clock, cpu_s=sum(cpu),
            cpu_us_per_step_median=statistics.median(cpu) * 1e6 if cpu else 0.0,
            cpu_us_per_step_p99=quantile(sorted(cpu), 0.99) * 1e6,
            wall_s=time.perf_counter() - self.wall0, usage=self.usage, interrupted=interrupted,
            **latency_summary(self.arrival, self.first_token, self.admitted),
            output_tokens_per_s=self.output_tokens / self.clock * 1000 if self.clock else 0.0)


def make_request(manager: KVCacheManager, tr: TraceRequest) -> Request:
    return manager.make_request(tr.request_id, tr.prompt_token_ids(),
                                max_tokens=max(tr.output_len, 1), ignore_eos=True,
                                session_id=tr.session_id)


def _teach_oracle(oracle: ReplayBelady, manager: KVCacheManager,
                  order: Sequence[TraceRequest]) -> tuple[dict[str, Request], dict[str, int]]:
    """Make every request up front and tell the offline policy which arrival indices can hit
    each hash (a prompt's full blocks, the last token excluded, as a lookup caps them)."""
    made: dict[str, Request] = {}
    index: dict[str, int] = {}
    uses: dict[BlockHash, list[int]] = {}
    for i, tr in enumerate(order):
        if tr.num_prompt_tokens >= manager.max_model_len:
            continue  # rejected on arrival, never made (see replay)
        req = make_request(manager, tr)
        made[tr.request_id] = req
        index[tr.request_id] = i
        for h in req.block_hashes[:(tr.num_prompt_tokens - 1) // manager.hash_block_size]:
            uses.setdefault(h, []).append(i)
    oracle.uses = uses
    return made, index


def progress_bar(total: int) -> Any:
    try:
        from tqdm import tqdm
    except ImportError:  # progress is optional
        return None
    return tqdm(total=total, unit="req", desc="replay", file=sys.stderr)
