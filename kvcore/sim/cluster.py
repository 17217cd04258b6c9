"""Replay a trace on N replicas behind a router, under one simulated clock.

Each replica is a real :class:`~kvcore.scheduler.Scheduler` over its own
:class:`~kvcore.manager.KVCacheManager` (the configuration of :class:`ReplayConfig`, per
replica).  Every replica publishes its KV events after each step through an
:class:`~kvcore.cluster.index.EventChannel` (the bytes a ZeroMQ publisher would send, decoded by
the index as a subscriber would); the router sees only that index and the replicas' queue
lengths when a request arrives.

With ``router="dynamo"`` the replicas also publish every batch on real ZeroMQ publishers
(127.0.0.1, ports chosen by the OS) to NVIDIA Dynamo's KV indexer, a process the replay starts
and always stops (:mod:`kvcore.cluster.dynamo`), and requests are routed by its answers.  Before
each routing decision the replay waits until the indexer has applied every batch published so
far (a marker block per replica, :class:`~kvcore.cluster.dynamo.DynamoFeed`), so the run is
deterministic; kvcore's index is still fed in process, and where its answers differ from
Dynamo's the result counts it (``dynamo["disagreements"]``).

The clock is event driven: the next thing to happen is either the next arrival (routed at its
arrival time) or the end of the step of the replica that finishes first; each step takes
``step_base_ms + step_ms_per_token × batched tokens`` on its replica, replicas run in parallel.
Reported: the cluster's token hit rate (hits over prompt tokens at first admission, summed over
replicas), per-replica requests, tokens, hits and busy time, the imbalance (the busiest
replica's busy time over the mean), and time to first token (median and p99).
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from kvcore.cluster.index import EventChannel, KVRoutingIndex, request_keys
from kvcore.cluster.router import ROUTERS, ReplicaLoad, Router, make_router
from kvcore.errors import InvalidArgumentError
from kvcore.events import KVCacheEvent
from kvcore.manager import KVCacheManager
from kvcore.scheduler import RequestRejectedError, Scheduler
from kvcore.sim.clock import StepCost, quantile
from kvcore.sim.oracle import REPLAY_ORACLES
from kvcore.sim.replay import (
    ReplayConfig,
    SimulatedStep,
    check_inputs,
    make_manager,
    make_request,
    make_scheduler,
)
from kvcore.sim.traces import TraceRequest


@dataclass(frozen=True)
class ClusterConfig:
    """How many replicas and how requests are routed to them."""

    num_replicas: int = 2
    router: str = "prefix"  # one of kvcore.cluster.ROUTERS
    load_weight: float = 1.0  # the prefix router's weight of a pending token vs a cached one
    medium_weights: Mapping[str, float] | None = None  # the index's tier weights

    def __post_init__(self) -> None:
        if type(self.num_replicas) is not int or self.num_replicas < 1:
            raise InvalidArgumentError(
                f"num_replicas must be a positive int, got {self.num_replicas!r}")
        if self.router not in ROUTERS:
            raise InvalidArgumentError(
                f"unknown router {self.router!r}; choose from {', '.join(ROUTERS)}")


@dataclass
class ReplicaResult:
    requests: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    token_hit_rate: float = 0.0
    host_hit_tokens: int = 0
    scheduled_tokens: int = 0
    busy_ms: float = 0.0
    steps: int = 0
    evicted_blocks: int = 0
    preemptions: int = 0
    # At the end: this replica's entries in the routing index per medium, and the blocks its
    # host tier holds (each held block was announced by a medium="CPU" event).
    indexed_blocks: dict[str, int] = field(default_factory=dict)
    host_blocks_held: int = 0


@dataclass
class ClusterResult:
    num_replicas: int
    router: str
    num_requests: int
    num_finished: int
    num_rejected: int
    prompt_tokens: int
    hit_tokens: int
    token_hit_rate: float
    host_hit_tokens: int
    host_hit_rate: float
    imbalance: float
    ttft_ms_median: float
    ttft_ms_p99: float
    sim_time_ms: float
    event_batches: int
    event_bytes: int
    index_blocks: int
    wall_s: float
    replicas: list[ReplicaResult] = field(default_factory=list)
    interrupted: bool = False  # stopped early (should_stop): the counts cover the steps run
    # router "dynamo": its disagreements with kvcore's index, and what the indexer cost:
    # start_s, queries, barriers, barrier_polls, barrier_s.
    dynamo: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self) -> str:
        return (f"{self.num_finished}/{self.num_requests} requests on {self.num_replicas} "
                f"replicas ({self.router}); token hit rate {self.token_hit_rate:.2%}; "
                f"imbalance {self.imbalance:.2f}; TTFT median {self.ttft_ms_median:.0f} ms")


class _Replica:
    """One replica: scheduler + manager, its clock and its event channel."""

    def __init__(self, rid: int, cfg: ReplayConfig, requests: Sequence[TraceRequest],
                 index: KVRoutingIndex) -> None:
        self.rid = rid
        self.manager: KVCacheManager = make_manager(cfg, requests, enable_events=True)
        self.sched: Scheduler = make_scheduler(self.manager, cfg)
        self.channel = EventChannel(index, rid)
        # Where else the replica's batches go (the dynamo router's publishers).
        self.sink: Callable[[int, list[KVCacheEvent], float], object] | None = None
        self.step_once = SimulatedStep(self.sched, self._publish)
        self.clock = 0.0
        self.result = ReplicaResult()

    def load(self) -> ReplicaLoad:
        s = self.sched
        pending = sum(r.num_tokens - r.num_computed_tokens for r in s.waiting)
        # A decoding request has one uncomputed token: not a backlog.
        pending += sum(n for r in s.running if (n := r.num_tokens - r.num_computed_tokens) > 1)
        return ReplicaLoad(s.num_waiting + s.num_running, pending, self.manager.usage)

    def _publish(self, events: list[KVCacheEvent]) -> None:
        self.channel.publish(events, self.clock / 1000)
        if self.sink is not None and events:
            self.sink(self.rid, events, self.clock / 1000)

    def step(self, clock: StepCost, arrival: dict[str, float], ttft: list[float]) -> int:
        """Run one step; returns the number of requests that finished."""
        out, done = self.step_once()
        cost = clock.step_ms(out.num_batched_tokens)
        self.clock += cost
        self.result.busy_ms += cost
        for s in out.scheduled:
            if s.samples and s.request.num_output_tokens == 1:
                ttft.append(self.clock - arrival[s.request_id])
        return len(done)


def replay_cluster(requests: Sequence[TraceRequest], cfg: ReplayConfig | None = None,
                   cluster: ClusterConfig | None = None, *,
                   on_finished: Callable[[int], object] | None = None,
                   should_stop: Callable[[], bool] | None = None) -> ClusterResult:
    """Run ``requests`` on ``cluster.num_replicas`` replicas (see the module docstring).
    ``on_finished(n)`` is called as requests finish (a progress bar); ``should_stop``, asked
    before every event, ends the run early with what was done (``interrupted``)."""
    cfg = cfg or ReplayConfig()
    cluster = cluster or ClusterConfig()
    if not requests:
        raise InvalidArgumentError("the trace has no requests")
    check_inputs(requests, cfg)
    if cfg.eviction_policy in REPLAY_ORACLES:
        raise InvalidArgumentError(f"the {cfg.eviction_policy} oracle replays one replica only")
    if cluster.router == "dynamo" and cfg.host_blocks:
        raise InvalidArgumentError(f"the dynamo router does not weigh a host tier (host_blocks="
                                   f"{cfg.host_blocks}): use the prefix router, or no host tier")
    index = KVRoutingIndex(cluster.medium_weights)
    reps = [_Replica(i, cfg, requests, index) for i in range(cluster.num_replicas)]
    with contextlib.ExitStack() as stack:
        router = _make_router(stack, cluster, index, reps)
        return _run(requests, cfg, cluster, index, reps, router, on_finished, should_stop)


def _make_router(stack: contextlib.ExitStack, cluster: ClusterConfig, index: KVRoutingIndex,
                 reps: list[_Replica]) -> Router:
    """The configured router; for ``dynamo``, its indexer process and publishers too, closed by
    ``stack`` (on errors and Ctrl-C as well)."""
    block_size = reps[0].manager.hash_block_size
    if cluster.router != "dynamo":
        return make_router(cluster.router, index, block_size, cluster.load_weight)
    from kvcore.cluster.dynamo import DynamoFeed, DynamoIndexer, DynamoRouter

    indexer = stack.enter_context(DynamoIndexer())
    feed = stack.enter_context(DynamoFeed.open(indexer, len(reps), block_size))
    feed.barrier()  # every replica's stream reaches the indexer before the first request
    router = DynamoRouter(feed, index, block_size, cluster.load_weight)
    for rep in reps:
        rep.sink = router.publish
    return router


def _run(requests: Sequence[TraceRequest], cfg: ReplayConfig, cluster: ClusterConfig,
         index: KVRoutingIndex, reps: list[_Replica], router: Router,
         on_finished: Callable[[int], object] | None,
         should_stop: Callable[[], bool] | None) -> ClusterResult:
    hash_block_size = reps[0].manager.hash_block_size
    clock = cfg.step_cost()
    pending = deque(sorted(requests, key=lambda r: r.arrival_ms))
    arrival: dict[str, float] = {}
    ttft: list[float] = []
    rejected = finished = 0
    wall0 = time.perf_counter()
    interrupted = False
    while True:
        if should_stop is not None and should_stop():
            interrupted = True
            break
        busy = [r for r in reps if r.sched.has_unfinished_requests()]
        next_step = min(busy, key=lambda r: (r.clock, r.rid)) if busy else None
        t_arrival = clock.arrival(pending[0].arrival_ms) if pending else math.inf
        if next_step is None and not pending:
            break
        if next_step is None or t_arrival <= next_step.clock:
            tr = pending.popleft()
            req = make_request(reps[0].manager, tr)  # every replica hashes alike
            keys = request_keys(req.block_hashes, tr.num_prompt_tokens, hash_block_size)
            rep = reps[router.route(keys, tr.num_prompt_tokens, [r.load() for r in reps],
                                    req.all_token_ids)]
            if not rep.sched.has_unfinished_requests():
                rep.clock = max(rep.clock, t_arrival)  # an idle replica waits for work
            try:
                rep.sched.add_request(req)
            except RequestRejectedError:
                rejected += 1
                continue
            arrival[tr.request_id] = t_arrival
            rep.result.requests += 1
            rep.result.prompt_tokens += tr.num_prompt_tokens
            continue
        n = next_step.step(clock, arrival, ttft)
        finished += n
        if n and on_finished is not None:
            on_finished(n)
    hits = queries = 0
    for rep in reps:
        res = rep.result
        stats = rep.manager.make_prefix_cache_stats()
        res.hit_tokens = stats.hits if stats else 0
        res.token_hit_rate = res.hit_tokens / stats.queries if stats and stats.queries else 0.0
        hits += res.hit_tokens
        queries += stats.queries if stats else 0
        res.host_hit_tokens = rep.sched.stats.external_hit_tokens
        res.steps = rep.sched.stats.steps
        res.scheduled_tokens = rep.sched.stats.scheduled_tokens
        res.evicted_blocks = rep.manager.pool.num_evicted_blocks
        res.preemptions = rep.sched.stats.num_preemptions
        res.indexed_blocks = {m: n for m in ("GPU", "CPU")
                              if (n := index.num_blocks(rep.rid, m))}
        host = getattr(rep.sched.connector, "host", None)
        res.host_blocks_held = len(host) if host is not None else 0
    busy_ms = [r.result.busy_ms for r in reps]
    mean_busy = statistics.fmean(busy_ms)
    ttft.sort()
    return ClusterResult(
        num_replicas=len(reps), router=cluster.router, num_requests=len(requests),
        num_finished=finished, num_rejected=rejected,
        prompt_tokens=sum(r.result.prompt_tokens for r in reps), hit_tokens=hits,
        token_hit_rate=hits / queries if queries else 0.0,
        host_hit_tokens=sum(r.result.host_hit_tokens for r in reps),
        host_hit_rate=sum(r.result.host_hit_tokens for r in reps) / queries if queries else 0.0,
        imbalance=max(busy_ms) / mean_busy if mean_busy else 1.0,
        ttft_ms_median=statistics.median(ttft) if ttft else 0.0,
        ttft_ms_p99=quantile(ttft, 0.99),
        sim_time_ms=max(r.clock for r in reps),
        event_batches=sum(r.channel.seq for r in reps),
        event_bytes=sum(r.channel.num_bytes for r in reps), index_blocks=len(index),
        wall_s=time.perf_counter() - wall0, replicas=[r.result for r in reps],
        interrupted=interrupted, dynamo=_dynamo_report(router))


def _dynamo_report(router: Router) -> dict[str, Any] | None:
    from kvcore.cluster.dynamo import DynamoRouter

    if not isinstance(router, DynamoRouter):
        return None
    feed = router.feed
    return {"disagreements": router.disagreements.to_dict(),
            "start_s": feed.indexer.start_s, "queries": feed.indexer.num_queries,
            "barriers": feed.num_barriers, "barrier_polls": feed.num_polls,
            "barrier_s": feed.barrier_s}
