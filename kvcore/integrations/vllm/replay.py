"""vLLM's real scheduler driven through a trace without a model, with vLLM's or kvcore's manager.

::

    python -m kvcore.integrations.vllm.replay shared-prefix --num-blocks 512
    python -m kvcore.integrations.vllm.replay TRACE.jsonl --block-size 512 --num-blocks 4096 \\
        --engines vllm,kvcore,kvcore:recommended --repeats 3 --json

As vLLM's own scheduler tests do, the engine's model runner is replaced by fabricated outputs:
every step's ``SchedulerOutput`` is answered with one sampled token per request whose prefill is
done (a deterministic function of request and position), and requests stop at their trace
output length.  Everything else is vLLM's ``Scheduler`` (``--async``: ``AsyncScheduler``, the
outputs of step N reported after step N+1 was scheduled, as vLLM's engine core overlaps them).

Each engine reports the prefix-cache hit rate (vLLM's ``PrefixCacheStats``), preemptions, and
the scheduler's CPU time per step (``schedule`` + ``update_from_output``; median over steps,
then median, min and max over repeats), and, measured in separate runs that time every call
into ``scheduler.kv_cache_manager``, the KV manager's share of it.  Repeats of all engines are
interleaved in one process.  Every kvcore engine that runs LRU is checked against vLLM's: the
same schedule (tokens per request, preemptions and new block ids, step by step), the same
prefix-cache stats and byte-identical KV-event batches (timestamps zeroed).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
import zlib
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import msgspec

from kvcore.integrations.vllm.settings import KvcoreSettings, parse_settings
from kvcore.sim.traces import TraceRequest

VOCAB = 32_000


@dataclass(frozen=True)
class Engine:
    """``vllm`` (vLLM's own manager) or ``kvcore`` with ``settings``; named as on the command
    line: ``vllm``, ``kvcore`` (LRU), ``kvcore:recommended``, ``kvcore:slru:protected_share=0.7``."""

    name: str
    settings: KvcoreSettings | None

    @staticmethod
    def parse(text: str) -> Engine:
        name = text.strip()
        if name == "vllm":
            return Engine(name, None)
        kind, _, policy = name.partition(":")
        if kind != "kvcore":
            raise ValueError(f"unknown engine {text!r}: vllm, kvcore or kvcore:POLICY")
        return Engine(name, parse_settings({"eviction_policy": policy or "lru"}))

    @property
    def lru(self) -> bool:
        return self.settings is None or (self.settings.eviction_policy == "lru" and not (
            self.settings.queue_hints))


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
        clock = time.thread_time

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


def _model_dir() -> str:
    """A model directory with only a tiny config.json (the scheduler never loads weights)."""
    from transformers import LlamaConfig

    path = os.path.join(tempfile.gettempdir(), "kvcore-vllm-replay-model")
    if not os.path.exists(os.path.join(path, "config.json")):
        LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                    num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                    head_dim=32, max_position_embeddings=1 << 20).save_pretrained(path)
    return path


@dataclass(frozen=True)
class ReplaySetup:
    """The scheduler configuration shared by every engine of a run."""

    block_size: int = 16
    num_blocks: int = 1024
    max_model_len: int = 8192
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_caching: bool = True
    async_scheduling: bool = False
    kv_cache_groups: Callable[[], list[Any]] | None = None  # default: one full-attention group
    # vLLM's CacheConfig.prefix_cache_retention_interval (sliding-window groups: kvcore needs
    # None, every block cached; vLLM's default 0 keeps only replay-boundary tails).
    prefix_cache_retention_interval: int | None = 0
    kv_transfer_config: dict[str, Any] | None = None  # a KV connector (vLLM's KVTransferConfig)
    # vLLM's KVCacheTensors (default none): a connector that sizes a tier from them needs them.
    kv_cache_tensors: Callable[[], list[Any]] | None = None
    # vLLM's deferred block frees, as a P/D decode instance (KV consumer) or CPU offloading has
    # them with overlapped steps; vLLM's CPU build turns async scheduling off with a connector,
    # so they are forced on here, as vLLM's own tests do.
    defer_block_free: bool = False
    # Requests end on a stop token at their trace length instead of reaching max_tokens, which
    # the scheduler cannot foresee: with overlapped steps a finished request was already
    # scheduled once more (what deferred frees exist for).
    stop_by_token: bool = False
    # vLLM's SchedulerConfig.watermark (admissions keep that fraction of the blocks free).
    watermark: float = 0.0
    # vLLM's ObservabilityConfig.kv_cache_metrics, every block sampled (recorded per step).
    kv_cache_metrics: bool = False
    # Requests carry prompt embeddings (each position's embedding its token) instead of tokens.
    prompt_embeds: bool = False
    # A hybrid model's groups instead of one full-attention group: a Mamba2-style state group
    # in vLLM's "align" mode (with its prefill checkpoint block) and a full-attention group,
    # both at ``block_size``, as vLLM configures Granite 4 / Nemotron-H under prefix caching.
    hybrid: bool = False
    # vLLM's SchedulerConfig.policy: "fcfs" or "priority".
    scheduling_policy: str = "fcfs"


def _hybrid_groups(block_size: int) -> list[Any]:
    """A Mamba2 layer's state group ("align", one prefill checkpoint block) and a full-attention
    group, as vLLM builds them for a hybrid model (page sizes are irrelevant without a model)."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, MambaSpec

    return [KVCacheGroupSpec(["layer.0"], MambaSpec(
                block_size=block_size, shapes=((4, 64), (8, 32, 16)),
                dtypes=(torch.float32, torch.float32), mamba_cache_mode="align",
                num_prefill_checkpoint_blocks=1, prefill_checkpoint_alignment=1)),
            KVCacheGroupSpec(["layer.1"], FullAttentionSpec(
                block_size=block_size, num_kv_heads=1, head_size=32, dtype=torch.float32))]


def make_scheduler(setup: ReplaySetup, engine: Engine, scheduler_cls: type | None = None,
                   additional_config: dict[str, Any] | None = None) -> Any:
    """vLLM's Scheduler (or AsyncScheduler) for ``setup``, with vLLM's manager or kvcore's
    (``scheduler_cls``: this class instead, e.g. the general plugin's; ``additional_config``:
    vLLM's, instead of the engine's settings)."""
    import torch
    from vllm.config import (
        CacheConfig,
        KVEventsConfig,
        KVTransferConfig,
        ModelConfig,
        ObservabilityConfig,
        SchedulerConfig,
        VllmConfig,
    )
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    model_config = ModelConfig(model=_model_dir(), skip_tokenizer_init=True, dtype="float16",
                               max_model_len=setup.max_model_len, seed=0,
                               enable_prompt_embeds=setup.prompt_embeds)
    scheduler_config = SchedulerConfig(
        max_num_seqs=setup.max_num_seqs, max_num_batched_tokens=setup.max_num_batched_tokens,
        max_model_len=setup.max_model_len, is_encoder_decoder=False,
        enable_chunked_prefill=True, async_scheduling=setup.async_scheduling,
        watermark=setup.watermark, policy=setup.scheduling_policy)
    cache_config = CacheConfig(
        block_size=setup.block_size, enable_prefix_caching=setup.enable_caching,
        prefix_cache_retention_interval=setup.prefix_cache_retention_interval,
        **({"mamba_cache_mode": "align", "mamba_block_size": setup.block_size}
           if setup.hybrid else {}))
    additional = ({} if engine.settings is None else {"kvcore": asdict(engine.settings)}
                  ) if additional_config is None else additional_config
    transfer = (None if setup.kv_transfer_config is None
                else KVTransferConfig(**setup.kv_transfer_config))
    vllm_config = VllmConfig(
        model_config=model_config, scheduler_config=scheduler_config, cache_config=cache_config,
        kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="null"),
        kv_transfer_config=transfer, additional_config=additional,
        observability_config=ObservabilityConfig(kv_cache_metrics=setup.kv_cache_metrics,
                                                 kv_cache_metrics_sample=1.0))
    cache_config.num_gpu_blocks = setup.num_blocks
    groups = (setup.kv_cache_groups() if setup.kv_cache_groups is not None else
              _hybrid_groups(setup.block_size) if setup.hybrid else
              [KVCacheGroupSpec(["layer.0"], FullAttentionSpec(
                  block_size=setup.block_size, num_kv_heads=1, head_size=32,
                  dtype=torch.float16))])
    kv_cache_config = KVCacheConfig(
        num_blocks=setup.num_blocks, kv_cache_groups=groups,
        kv_cache_tensors=setup.kv_cache_tensors() if setup.kv_cache_tensors is not None else [],
        prefix_cache_retention_interval=cache_config.prefix_cache_retention_interval)
    from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler

    from kvcore.integrations.vllm import scheduler as kvcore_scheduler

    if scheduler_cls is not None:
        cls: type = scheduler_cls
    elif engine.settings is None:
        cls = AsyncScheduler if setup.async_scheduling else Scheduler
    else:
        cls = (kvcore_scheduler.AsyncScheduler if setup.async_scheduling
               else kvcore_scheduler.Scheduler)

    block_size, hash_block_size = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
    sched = cls(vllm_config=vllm_config, kv_cache_config=kv_cache_config,
                structured_output_manager=StructuredOutputManager(vllm_config),
                block_size=block_size, hash_block_size=hash_block_size, log_stats=True)
    if setup.defer_block_free:
        sched.defer_block_free = True
    return sched


def _token(rid: str, position: int) -> int:
    x = (zlib.crc32(rid.encode()) * 6364136223846793005 + position * 1442695040888963407)
    return ((x & (2**64 - 1)) >> 33) % VOCAB


def run(requests: Sequence[TraceRequest], setup: ReplaySetup, engine: Engine, *,
        time_manager: bool = False, record: bool = False) -> ReplayRun:
    """Drive one scheduler through ``requests`` (all queued at once, in arrival order).  As
    vLLM's engine core does once it has started, everything made before the first step is
    moved out of the garbage collector's sight for the run."""
    gc.collect()
    try:
        return _run(requests, setup, engine, time_manager, record)
    finally:
        gc.unfreeze()


def _run(requests: Sequence[TraceRequest], setup: ReplaySetup, engine: Engine,
         time_manager: bool, record: bool) -> ReplayRun:
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
    from vllm.v1.request import Request, RequestStatus

    sched = make_scheduler(setup, engine)
    recorder = _EventRecorder()
    sched.kv_event_publisher = recorder
    timer = None
    if time_manager:
        timer = _ManagerTimer(sched.kv_cache_manager)
        sched.kv_cache_manager = timer
    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)
    hasher = get_request_block_hasher(sched.hash_block_size, hash_fn)
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
        sched.add_request(Request(tr.request_id, tokens, params, None,
                                  arrival_time=tr.arrival_ms / 1000, block_hasher=hasher,
                                  session_id=tr.session_id, prompt_embeds=embeds))
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
    while sched.has_unfinished_requests() or in_flight:
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
                    "(shared-prefix, multi-turn, few-shot, random, agent)")
    ap.add_argument("--engines", default="vllm,kvcore,kvcore:recommended",
                    help="comma-separated: vllm, kvcore (LRU), kvcore:POLICY "
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
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    args = ap.parse_args(argv)
    from vllm.envs import enable_envs_cache

    enable_envs_cache()  # as vLLM's engine core does once it has started
    try:
        engines = [Engine.parse(e) for e in args.engines.split(",") if e.strip()]
    except ValueError as exc:
        ap.error(str(exc))
    requests = _load(args.trace, args.block_size)
    if args.max_requests:
        requests = requests[:args.max_requests]
    longest = max(r.num_prompt_tokens + r.output_len for r in requests)
    setup = ReplaySetup(block_size=args.block_size, num_blocks=args.num_blocks,
                        max_model_len=-(-(longest + 1) // args.block_size) * args.block_size,
                        max_num_seqs=args.max_num_seqs,
                        max_num_batched_tokens=max(args.max_num_batched_tokens, args.max_num_seqs),
                        async_scheduling=args.async_scheduling, hybrid=args.hybrid)
    recorded = {e.name: run(requests, setup, e, record=True) for e in engines}
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
            "step_us": _spread(step_us[e.name]) if args.repeats else None,
            "manager_us": _spread(manager_us[e.name]) if args.repeats else None,
            "identical_to_vllm": same})
    if args.json:
        print(json.dumps({"setup": asdict(setup) | {"kv_cache_groups": None},
                          "trace": args.trace, "results": rows}, indent=2))
    else:
        _print_table(rows, reference is not None)
    return 0 if all(row["identical_to_vllm"] is not False for row in rows) else 1


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _cell(spread: dict[str, float] | None) -> str:
    if spread is None:
        return "—"
    return f"{spread['median']:.1f} ({spread['min']:.1f}–{spread['max']:.1f})"


def _print_table(rows: list[dict[str, Any]], with_ratio: bool) -> None:
    base = next((r for r in rows if r["engine"] == "vllm"), None)
    print(f"{'engine':<24} {'hit rate':>8} {'steps':>6} {'preempt':>7} "
          f"{'sched µs/step (min–max)':>26} {'KV mgr µs/step (min–max)':>27} "
          f"{'mgr ratio':>9} {'same as vLLM':>12}")
    for r in rows:
        m = r["manager_us"]
        ratio = ""
        if base is not None and with_ratio and m is not None:
            ratio = f"{m['median'] / base['manager_us']['median']:.2f}×"
        same = {None: "", True: "yes", False: "NO"}[r["identical_to_vllm"]]
        print(f"{r['engine']:<24} {r['hit_rate']:>8.2%} {r['steps']:>6} {r['preemptions']:>7} "
              f"{_cell(r['step_us']):>26} {_cell(m):>27} {ratio:>9} {same:>12}")


if __name__ == "__main__":
    sys.exit(main())
