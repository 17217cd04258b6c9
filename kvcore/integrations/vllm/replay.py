"""vLLM's real scheduler driven through a trace without a model, with vLLM's or kvcore's manager.

::

    python -m kvcore.integrations.vllm.replay shared-prefix --num-blocks 512
    python -m kvcore.integrations.vllm.replay TRACE.jsonl --block-size 512 --num-blocks 4096 \\
        --engines vllm,kvcore,kvcore:recommended@lpm,kvcore:belady --repeats 3 --json

As vLLM's own scheduler tests do, the engine's model runner is replaced by fabricated outputs:
every step's ``SchedulerOutput`` is answered with one sampled token per request whose prefill is
done (a deterministic function of request and position), and requests stop at their trace
output length.  Everything else is vLLM's ``Scheduler`` (``--async``: ``AsyncScheduler``, the
outputs of step N reported after step N+1 was scheduled, as vLLM's engine core overlaps them).

Requests reach the scheduler on a simulated clock, kvcore's own replay's cost model
(:mod:`~kvcore.integrations.vllm.replay_clock`): at their trace arrival times ``--time-scale``,
each step taking ``--step-base-ms`` plus ``--step-ms-per-token`` per scheduled token; the clock
jumps to the next arrival when nothing runs.  ``--time-scale 0`` queues every request before the
first step (the replay's behaviour before it had a clock, which earlier benchmarks measured).

Engines (:mod:`~kvcore.integrations.vllm.replay_engine`): ``vllm``, ``kvcore`` (LRU),
``kvcore:POLICY``, a schedule policy for vLLM's waiting queue as a suffix (``kvcore@lpm``,
``kvcore:recommended@dfs-weight``; ``--max-waiting-steps`` sets every kvcore engine's starvation
bound), ``+no-memo`` before it for an engine without the head-of-line retry memo, and the
offline bounds ``kvcore:belady`` and ``kvcore:reuse_oracle``, which only this replay builds
(:mod:`~kvcore.integrations.vllm.replay_oracle`; vLLM's configuration refuses them).

Each engine reports the prefix-cache hit rate (vLLM's ``PrefixCacheStats``), preemptions, and
the scheduler's CPU time per step (``schedule`` + ``update_from_output``; median over steps,
then median, min and max over repeats), and, measured in separate runs that time every call
into ``scheduler.kv_cache_manager``, the KV manager's share of it: the time those calls take
per step, read from the wall clock (``perf_counter``, a vDSO read of some 25 ns; the median
over steps shrugs off a step another process interrupted), not from the thread's CPU clock
(a system call, ~0.7 µs a read on a VM, whose side effects slowed the compiled calls it timed
by ~0.3 µs each: BENCHMARKS.md, 2026-11-29, "manager-clock").  Repeats of all engines are
interleaved in one process.  From the clock: time to first token (arrival to the end of the step
that samples the first token) and queueing delay (arrival to the first scheduling), p50 / p99
(and the queueing mean), and the longest wait in scheduler steps (``max_wait_steps``; with a
non-FCFS schedule policy the replay also checks the starvation guard's order and raises if it is
broken).  Every kvcore engine that runs LRU with vLLM's FCFS queue is checked against vLLM's:
the same schedule (tokens per request, preemptions and new block ids, step by step), the same
prefix-cache stats and byte-identical KV-event batches (timestamps zeroed); with the clock both
see the same arrivals, since the clock follows the schedule.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
import zlib
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import msgspec

from kvcore.integrations.vllm.replay_clock import ArrivalClock, check_starvation
from kvcore.integrations.vllm.replay_engine import Engine
from kvcore.integrations.vllm.replay_oracle import OracleFeed
from kvcore.integrations.vllm.replay_report import print_table, spread
from kvcore.integrations.vllm.replay_setup import VOCAB, ReplaySetup, make_scheduler
from kvcore.integrations.vllm.settings import MAX_WAITING_STEPS
from kvcore.sim.clock import (
    STEP_BASE_MS,
    STEP_MS_PER_TOKEN,
    TIME_SCALE,
    StepCost,
    check_arrivals,
)
from kvcore.sim.traces import TraceRequest


@dataclass
class ReplayRun:
    """What one run of one engine produced."""

    engine: str
    steps: int
    preemptions: int
    queries: int
    hits: int
    finished: int
    # Most deferred frees pending after a step (vLLM's deferred_frees; 0 unless they are on).
    max_deferred_frees: int = 0
    step_cpu_us: list[float] = field(default_factory=list, repr=False)
    manager_cpu_us: list[float] = field(default_factory=list, repr=False)
    schedule: list[tuple[Any, ...]] = field(default_factory=list, repr=False)
    event_batches: list[bytes] = field(default_factory=list, repr=False)
    stats: list[tuple[Any, ...]] = field(default_factory=list, repr=False)
    # With kv_cache_metrics, per step: the collector's tracked blocks (id, accesses) and the
    # reuse-gap counts of the eviction records the step's stats carried.
    metrics: list[tuple[Any, ...]] = field(default_factory=list, repr=False)
    # The simulated clock's figures (ArrivalClock.summary: TTFT, queueing, max_wait_steps).
    latency: dict[str, float] = field(default_factory=dict)
    # Per request: scheduler steps from the first that saw it waiting to its first scheduling.
    wait_steps: dict[str, int] = field(default_factory=dict, repr=False)

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class _EventRecorder:
    """Stands in for vLLM's event publisher: keeps each batch's bytes, timestamp zeroed."""

    def __init__(self) -> None:
        self.batches: list[bytes] = []
        self._encoder = msgspec.msgpack.Encoder()

    def publish(self, batch: Any) -> None:
        self.batches.append(self._encoder.encode(msgspec.structs.replace(batch, ts=0.0)))

    def shutdown(self) -> None:
        pass


class _ManagerTimer:
    """Times every call made into a KV-cache manager from outside it, as a stand-in for it (the
    scheduler's ``kv_cache_manager``): methods are timed (nested calls count once), everything
    else is the manager's own.  ``net`` subtracts what the timing itself adds to each call
    (calibrated on a call that does nothing)."""

    def __init__(self, manager: Any) -> None:
        self._manager = manager
        self._timed: dict[str, Callable[..., Any]] = {}
        self.total = 0.0
        self.calls = 0
        self._depth = 0
        noop = self._wrap(lambda: None)
        for _ in range(20_000):
            noop()
        self.per_call = self.total / self.calls
        self.total = 0.0
        self.calls = 0

    def __getattr__(self, name: str) -> Any:
        timed = self._timed.get(name)
        if timed is not None:
            return timed
        value = getattr(self._manager, name)
        if callable(value) and not name.startswith("_") and not isinstance(value, type):
            timed = self._timed[name] = self._wrap(value)
            return timed
        return value

    def _wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        clock = time.perf_counter  # (see the module docstring: not the thread's CPU clock)

        def timed(*args: Any, **kwargs: Any) -> Any:
            if self._depth:
                return fn(*args, **kwargs)
            self._depth = 1
            t0 = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                self.total += clock() - t0
                self.calls += 1
                self._depth = 0
        return timed

    @property
    def net(self) -> float:
        return self.total - self.calls * self.per_call


def _token(rid: str, position: int) -> int:
    x = (zlib.crc32(rid.encode()) * 6364136223846793005 + position * 1442695040888963407)
    return ((x & (2**64 - 1)) >> 33) % VOCAB


def run(requests: Sequence[TraceRequest], setup: ReplaySetup, engine: Engine, *,
        time_manager: bool = False, record: bool = False) -> ReplayRun:
    """Drive one scheduler through ``requests`` (in arrival order, each added when the
    simulated clock reaches its arrival: :mod:`~kvcore.integrations.vllm.replay_clock`).  As
    vLLM's engine core does once it has started, everything made before the first step (every
    request included: made and hashed up front) is moved out of the garbage collector's sight
    for the run.  With a schedule policy other than FCFS, a broken starvation guard raises
    :class:`RuntimeError` (:func:`~kvcore.integrations.vllm.replay_clock.check_starvation`)."""
    check_arrivals(requests)
    gc.collect()
    try:
        return _run(requests, setup, engine, time_manager, record)
    finally:
        gc.unfreeze()


def _make_requests(requests: Sequence[TraceRequest], setup: ReplaySetup,
                   block_size: int) -> list[tuple[float, Any]]:
    """vLLM's requests for the trace's, hashed, in arrival order, with their arrival times."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)
    hasher = get_request_block_hasher(block_size, hash_fn)
    made = []
    for tr in sorted(requests, key=lambda r: r.arrival_ms):
        n = max(tr.output_len, 1)
        if setup.stop_by_token:  # the last token stops it; the scheduler cannot foresee that
            params = SamplingParams(max_tokens=n + 8, ignore_eos=True, stop_token_ids=[
                _token(tr.request_id, tr.num_prompt_tokens + n - 1)])
        else:
            params = SamplingParams(max_tokens=n, ignore_eos=True)
        tokens: list[int] | None = tr.prompt_token_ids()
        embeds = None
        if setup.prompt_embeds:  # position i's embedding stands for token i (4 dims)
            import torch

            embeds = torch.tensor(tokens, dtype=torch.float32)[:, None].repeat(1, 4)
            tokens = None
        made.append((tr.arrival_ms, Request(
            tr.request_id, tokens, params, None, arrival_time=tr.arrival_ms / 1000,
            block_hasher=hasher, session_id=tr.session_id, prompt_embeds=embeds)))
    return made


def _run(requests: Sequence[TraceRequest], setup: ReplaySetup, engine: Engine,
         time_manager: bool, record: bool) -> ReplayRun:
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
    from vllm.v1.request import RequestStatus

    sched = make_scheduler(setup, engine)
    recorder = _EventRecorder()
    sched.kv_event_publisher = recorder
    made = _make_requests(requests, setup, sched.hash_block_size)
    arrivals = ArrivalClock(made, setup.step_cost)
    oracle = OracleFeed(sched, [req for _, req in made]) if engine.oracle is not None else None
    timer = None
    if time_manager:
        timer = _ManagerTimer(sched.kv_cache_manager)
        sched.kv_cache_manager = timer
    gc.freeze()
    out = ReplayRun(engine.name, 0, 0, 0, 0, 0)
    depth = 2 if setup.async_scheduling else 1
    in_flight: deque[tuple[Any, Any]] = deque()
    clock = time.thread_time
    step_cpu = 0.0

    def report() -> None:
        nonlocal step_cpu
        so, mro = in_flight.popleft()
        t0 = clock()
        outputs = sched.update_from_output(so, mro)
        step_cpu += clock() - t0
        for eco in outputs.values():
            out.finished += sum(1 for o in eco.outputs if o.finish_reason is not None)
            stats = eco.scheduler_stats.prefix_cache_stats if eco.scheduler_stats else None
            if stats is not None:
                out.queries += stats.queries
                out.hits += stats.hits
                if record:
                    out.stats.append((stats.requests, stats.queries, stats.hits,
                                      stats.preempted_requests, stats.preempted_queries,
                                      stats.preempted_hits, stats.reset))
            collector = sched.kv_metrics_collector
            if record and collector is not None and eco.scheduler_stats is not None:
                out.metrics.append((
                    tuple(sorted((b, len(m.access_history))
                                 for b, m in collector.block_metrics.items())),
                    tuple(len(e.reuse_gaps_seconds)
                          for e in eco.scheduler_stats.kv_cache_eviction_events)))

    # A scheduler that stops making progress must not hang the replay.
    max_steps = 4 * sum(r.num_prompt_tokens + r.output_len for r in requests) + 1000
    while arrivals.pending or sched.has_unfinished_requests() or in_flight:
        arrivals.add_arrived(sched, out.steps)
        if not sched.has_unfinished_requests() and not in_flight:
            arrivals.jump()
            continue
        if out.steps > max_steps:
            raise RuntimeError(f"{engine.name}: no end after {out.steps} steps "
                               f"({out.finished} of {len(requests)} requests finished)")
        manager_before = timer.net if timer is not None else 0.0
        step_cpu = 0.0
        if sched.has_unfinished_requests():
            t0 = clock()
            so = sched.schedule()
            step_cpu += clock() - t0
            ids = list(so.num_scheduled_tokens)
            sampled = []
            for rid in ids:
                req = sched.requests[rid]
                sampled.append([] if req.num_computed_tokens < req.num_tokens
                               else [_token(rid, req.num_computed_tokens)])
            first = arrivals.step(so, (r for r, t in zip(ids, sampled) if t), out.steps)
            if oracle is not None:
                oracle.scheduled(first)
            mro = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                    sampled_token_ids=sampled)
            if sched.connector is not None:  # KV loads finish within the step that started them
                loaded = {r.request_id for r in sched.requests.values()
                          if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS}
                if loaded:
                    mro.kv_connector_output = KVConnectorOutput(finished_recving=loaded)
            in_flight.append((so, mro))
            out.steps += 1
            out.preemptions += len(so.preempted_req_ids or ())
            if record:
                out.max_deferred_frees = max(out.max_deferred_frees, len(sched.deferred_frees))
                out.schedule.append(_step_record(so))
            if len(in_flight) >= depth or not so.total_num_scheduled_tokens:
                report()
        else:
            report()
        out.step_cpu_us.append(step_cpu * 1e6)
        if timer is not None:
            out.manager_cpu_us.append((timer.net - manager_before) * 1e6)
    out.event_batches = recorder.batches if record else []
    out.latency = arrivals.summary()
    out.wait_steps = arrivals.wait_steps()
    if engine.reorders and engine.settings is not None:
        check_starvation(engine.name, arrivals.order, out.wait_steps, arrivals.scheduled_step,
                         engine.settings.max_waiting_steps)
    return out


def _step_record(so: Any) -> tuple[Any, ...]:
    new = tuple(sorted((r.req_id, tuple(map(tuple, r.block_ids))) for r in so.scheduled_new_reqs))
    cached = so.scheduled_cached_reqs
    grown = tuple(sorted((rid, tuple(map(tuple, ids)) if ids is not None else None)
                         for rid, ids in zip(cached.req_ids, cached.new_block_ids)))
    return (tuple(sorted(so.num_scheduled_tokens.items())), new, grown,
            tuple(sorted(so.preempted_req_ids or ())))


def differences(a: ReplayRun, b: ReplayRun) -> list[str]:
    """Where two recorded runs differ (schedule, prefix-cache stats, KV-event bytes, residency
    metrics)."""
    diffs = []
    for what in ("schedule", "stats", "event_batches", "metrics"):
        x, y = getattr(a, what), getattr(b, what)
        if x != y:
            step = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
            diffs.append(f"{what} differs from step {step} ({len(x)} vs {len(y)} entries)")
    return diffs


def _load(source: str, block_size: int) -> list[TraceRequest]:
    from kvcore.sim.traces import load_mooncake
    from kvcore.sim.workloads import make_workload

    if os.path.exists(source):
        return load_mooncake(source)
    return make_workload(source)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvcore.integrations.vllm.replay",
                                 description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("trace", help="a Mooncake-format trace file or a built-in workload "
                    "(shared-prefix, multi-turn, few-shot, random, agent, api, rag)")
    ap.add_argument("--engines", default="vllm,kvcore,kvcore:recommended",
                    help="comma-separated: vllm (vLLM's manager), kvcore (LRU), kvcore:POLICY "
                    "(recommended, learned, slru, slru:protected_share=0.7, s3fifo, arc; +hints=N: "
                    "queue hints), a schedule "
                    "policy for vLLM's waiting queue as a suffix (kvcore@lpm, "
                    "kvcore:recommended@dfs-weight; fcfs, lpm, dfs-weight, recommended), "
                    "+no-memo before it: without the head-of-line retry memo, or the "
                    "offline bounds kvcore:belady and kvcore:reuse_oracle (arrival order only) "
                    "(default: %(default)s)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--num-blocks", type=int, default=1024)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--max-requests", type=int, default=0, help="replay only the first N")
    ap.add_argument("--async", dest="async_scheduling", action="store_true",
                    help="vLLM's AsyncScheduler (step N+1 scheduled before N is reported)")
    ap.add_argument("--repeats", type=int, default=3,
                    help="timed runs of every engine, interleaved (0: hit rates and the "
                    "comparison with vLLM only)")
    ap.add_argument("--hybrid", action="store_true",
                    help="a hybrid model's groups: a Mamba2 state group in vLLM's 'align' mode "
                    "and a full-attention group (default: one full-attention group)")
    ap.add_argument("--max-waiting-steps", type=int, metavar="STEPS",
                    help="every kvcore engine's starvation bound for a non-FCFS schedule "
                    f"policy (default: {MAX_WAITING_STEPS})")
    ap.add_argument("--time-scale", type=float, default=TIME_SCALE,
                    help="simulated clock: requests arrive at their trace time times this "
                    "(< 1 loads the scheduler more; 0: every request queued at once, as before "
                    "the clock) (default: %(default)s)")
    ap.add_argument("--step-base-ms", type=float, default=STEP_BASE_MS,
                    help="simulated cost of a scheduler step (default: %(default)s ms)")
    ap.add_argument("--step-ms-per-token", type=float, default=STEP_MS_PER_TOKEN,
                    help="simulated cost of each token a step schedules "
                    "(default: %(default)s ms)")
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    args = ap.parse_args(argv)
    from vllm.envs import enable_envs_cache

    enable_envs_cache()  # as vLLM's engine core does once it has started
    try:
        engines = [Engine.parse(e, args.max_waiting_steps)
                   for e in args.engines.split(",") if e.strip()]
        cost = StepCost(args.step_base_ms, args.step_ms_per_token, args.time_scale)
    except ValueError as exc:
        ap.error(str(exc))
    if args.hybrid and any(e.oracle for e in engines):
        ap.error("the offline bounds replay one KV-cache group (not --hybrid)")
    requests = _load(args.trace, args.block_size)
    if args.max_requests:
        requests = requests[:args.max_requests]
    longest = max(r.num_prompt_tokens + r.output_len for r in requests)
    setup = ReplaySetup(block_size=args.block_size, num_blocks=args.num_blocks,
                        max_model_len=-(-(longest + 1) // args.block_size) * args.block_size,
                        max_num_seqs=args.max_num_seqs,
                        max_num_batched_tokens=max(args.max_num_batched_tokens, args.max_num_seqs),
                        async_scheduling=args.async_scheduling, hybrid=args.hybrid,
                        step_cost=cost)
    # Schedules and event bytes are kept only where they are compared (vLLM's and kvcore's LRU
    # engines): on a long trace they take gigabytes per engine.
    compare = any(e.settings is not None and e.lru for e in engines)
    recorded = {e.name: run(requests, setup, e, record=compare and e.lru) for e in engines}
    step_us: dict[str, list[float]] = {e.name: [] for e in engines}
    manager_us: dict[str, list[float]] = {e.name: [] for e in engines}
    for _ in range(args.repeats):  # interleaved: every engine once per round
        for e in engines:
            step_us[e.name].append(statistics.median(run(requests, setup, e).step_cpu_us))
            manager_us[e.name].append(statistics.median(
                run(requests, setup, e, time_manager=True).manager_cpu_us))
    reference = recorded.get("vllm")
    rows = []
    for e in engines:
        r = recorded[e.name]
        same = None
        if reference is not None and e.settings is not None and e.lru:
            same = not differences(reference, r)
        rows.append({
            "engine": e.name, "requests": len(requests), "finished": r.finished,
            "steps": r.steps, "preemptions": r.preemptions, "hit_rate": r.hit_rate,
            "step_us": spread(step_us[e.name]) if args.repeats else None,
            "manager_us": spread(manager_us[e.name]) if args.repeats else None,
            "identical_to_vllm": same, **r.latency})
    if args.json:
        print(json.dumps({"setup": asdict(setup) | {"kv_cache_groups": None},
                          "trace": args.trace, "results": rows}, indent=2))
    else:
        print_table(rows, reference is not None)
    return 0 if all(row["identical_to_vllm"] is not False for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
