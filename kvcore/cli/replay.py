"""``kvcore replay``: a trace (or a built-in workload) through the real scheduler and pool, on the
simulated clock, optionally on several replicas behind routers, publishing its KV events, and
against the one-request-at-a-time policy simulations.

:func:`cmd_replay` is the subcommand; its steps are :func:`replay_config` (the options as a
:class:`~kvcore.sim.replay.ReplayConfig`), :func:`run_replay` (one replay, clustered or
publishing), :func:`simulate_policies` (``--policy`` and ``--plot``) and :func:`print_replay`
(the text report; ``--json`` prints the dictionary instead).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvcore.errors import InvalidArgumentError
from kvcore.eviction import RECOMMENDED, RECOMMENDED_NAME
from kvcore.sim.interrupt import INTERRUPTED, SigintStop, partial_note

if TYPE_CHECKING:
    from kvcore.sim.replay import ReplayConfig


def _load(args: argparse.Namespace) -> tuple[str, list[Any]]:
    from kvcore.sim import traces, workloads

    if args.trace is not None:  # an empty TRACE is an error, not the built-in workload
        reqs = traces.load_mooncake(args.trace, limit=args.limit,
                                    max_model_len=args.max_model_len)
        return args.trace, reqs
    reqs = workloads.make_workload(args.workload)
    if args.limit:
        reqs = reqs[:args.limit]
    return f"workload:{args.workload}", reqs


def cmd_replay(args: argparse.Namespace) -> int:
    if args.plot is not None:  # before the run, not after it
        from kvcore.sim.plots import check_plot_path

        check_plot_path(args.plot)
    source, reqs = _load(args)
    cfg, policy = replay_config(args, len(reqs))
    num_blocks = cfg.resolve_num_blocks()
    if args.publish_replay is not None and args.publish is None:
        raise InvalidArgumentError("--publish-replay needs --publish")
    clustered = args.replicas > 1 or args.router is not None
    if clustered and args.publish is not None:
        raise InvalidArgumentError("--publish streams one replica's events; it cannot be "
                                   "combined with --replicas/--router")
    stop = SigintStop()  # Ctrl-C: the replay ends at its next step, results marked partial
    result, results, published = run_replay(reqs, cfg, args, clustered, stop)
    out: dict[str, Any] = {"source": source, "requests": len(reqs), "block_size": args.block_size,
                           "num_blocks": num_blocks, "eviction_policy": policy,
                           "queue_hints": cfg.queue_hints,
                           "schedule_policy": cfg.schedule_policy, "replay": result.to_dict()}
    if args.publish is not None:
        out["published"] = published
    out["replay"].pop("usage", None)
    if clustered:
        out["replicas"] = args.replicas
        out["router"] = result.router
        if args.router is not None and len(args.router) > 1:
            out["routers"] = {r.router: r.to_dict() for r in results}
    simulate_policies(out, reqs, args, num_blocks, source, cfg.progress, stop)
    if stop.requested:
        out["partial"] = True
        print(partial_note(out, args.policy, args.plot), file=sys.stderr)
    if args.json:
        print(json.dumps(out, indent=1))
        return INTERRUPTED if stop.requested else 0
    if clustered:
        from kvcore.sim.cluster_report import router_table

        for r in results:
            _print_cluster(source, r, num_blocks, args.block_size, policy, args.host_blocks,
                           args.host_policy)
        if len(results) > 1:
            print(f"\nrouters on {source}, {args.replicas} replicas (same trace, same "
                  "simulated clock):")
            print("\n".join(router_table(results)))
        return INTERRUPTED if stop.requested else 0
    print_replay(out, result, args, cfg, num_blocks, policy)
    return INTERRUPTED if stop.requested else 0


def replay_config(args: argparse.Namespace, num_requests: int) -> tuple[ReplayConfig, str]:
    """The replay's configuration from the options, and the eviction policy's name (the
    recommended setting resolved)."""
    from kvcore.sim.replay import ReplayConfig

    capacity = args.capacity_tokens if args.num_blocks is None and args.capacity_tokens else None
    if args.num_blocks is None and capacity is None:
        capacity = 4_194_304 if args.trace is not None else 16_384
    policy, hints = args.eviction_policy, args.queue_hints
    if policy == RECOMMENDED_NAME:
        policy = RECOMMENDED.policy
        hints = RECOMMENDED.queue_hints if hints is None else hints
    progress = not args.no_progress and num_requests > 200  # on stderr, also with --json
    cfg = ReplayConfig(block_size=args.block_size, num_blocks=args.num_blocks,
                       capacity_tokens=capacity, max_model_len=args.max_model_len,
                       max_num_seqs=args.max_num_seqs,
                       max_num_batched_tokens=args.max_num_batched_tokens,
                       eviction_policy=policy, queue_hints=hints or 0, progress=progress,
                       host_blocks=args.host_blocks, host_eviction_policy=args.host_policy,
                       host_admit_after=args.host_admit_after,
                       schedule_policy=args.schedule_policy,
                       max_waiting_steps=args.max_waiting_steps)
    return cfg, policy


def run_replay(reqs: list[Any], cfg: ReplayConfig, args: argparse.Namespace, clustered: bool,
               stop: SigintStop) -> tuple[Any, list[Any], dict[str, Any] | None]:
    """One replay: on a cluster (the first router's result, and every router's), publishing
    its KV events (and what the publisher did), or plain."""
    from kvcore.sim.replay import replay

    results: list[Any] = []
    published: dict[str, Any] | None = None
    if clustered:
        with stop:
            results = _replay_cluster(reqs, cfg, args, cfg.progress, stop)
        result = results[0]
    elif args.publish is not None:
        from kvcore.events.publisher import ZmqEventPublisher

        with ZmqEventPublisher(args.publish, args.publish_replay) as publisher, stop:
            print(f"kvcore: publishing KV events: {publisher.describe()}", file=sys.stderr)
            result = replay(reqs, cfg, event_sink=publisher.publish, should_stop=stop)
        published = {"endpoint": publisher.endpoint, "mode": publisher.mode,
                      "peer_connected": publisher.peer_connected,
                      "batches": publisher.num_published, "dropped": publisher.num_dropped}
        if (warning := publisher.undelivered_warning()) is not None:
            print(f"kvcore: warning: {warning}", file=sys.stderr)
    else:
        with stop:
            result = replay(reqs, cfg, should_stop=stop)
    return result, results, published


def simulate_policies(out: dict[str, Any], reqs: list[Any], args: argparse.Namespace,
                      num_blocks: int, source: str, progress: bool, stop: SigintStop) -> None:
    """``--policy`` and ``--plot``: the one-request-at-a-time simulations at the replay's capacity
    (and, for the plot, around it), added to ``out``.  A Ctrl-C drops those not done yet."""
    from kvcore.sim.policies import hit_rate_curve, ideal_hit_rate, to_block_requests

    block_reqs = []
    try:  # the policy simulations: a Ctrl-C drops those not done yet
        if (args.policy or args.plot) and not stop.requested:
            block_reqs = to_block_requests(reqs, args.block_size)
            out["ideal_hit_rate"] = ideal_hit_rate(block_reqs, args.block_size)
        if args.policy and not stop.requested:
            sims = hit_rate_curve(block_reqs, [num_blocks - 1], args.policy, args.block_size,
                                  progress=progress)
            out["policies"] = {p: rs[0].hit_rate for p, rs in sims.items()}
            out["policies_skipped"] = {p: rs[0].skipped for p, rs in sims.items()}
        if args.plot and not stop.requested:
            from kvcore.sim.plots import plot_hit_rate_curves

            top = num_blocks - 1
            caps = sorted({max(1, top >> k) for k in range(7)} | {top * 2, top * 4})
            curves = hit_rate_curve(block_reqs, caps, args.policy or ["lru", "belady"],
                                    args.block_size, progress=progress)
            plot_hit_rate_curves(curves, block_size=args.block_size,
                                 ideal=out["ideal_hit_rate"],
                                 title=Path(args.trace).name if args.trace else source,
                                 path=args.plot)
            out["plot"] = args.plot
            # [capacity in tokens, hit rate (None when every request was skipped), skipped]
            out["curves"] = {p: [[r.capacity_blocks * args.block_size,
                                  r.hit_rate if r.prompt_tokens else None, r.skipped]
                                 for r in rs] for p, rs in curves.items()}
    except KeyboardInterrupt:
        stop.requested = True


def print_replay(out: dict[str, Any], result: Any, args: argparse.Namespace,
                 cfg: ReplayConfig, num_blocks: int, policy: str) -> None:
    """The text report of a single-instance replay (``out`` is what ``--json`` prints)."""
    r = result
    print(f"replayed {out['source']}: {r.num_finished} of {out['requests']} requests finished "
          f"({r.num_rejected} rejected) in {r.steps} steps, {r.wall_s:.2f}s wall")
    print(f"  KV cache:        {num_blocks - 1} blocks x {args.block_size} tokens "
          f"= {(num_blocks - 1) * args.block_size:,} tokens; eviction {policy}, queue hints "
          f"{cfg.queue_hints or 'off'}; schedule {cfg.schedule_policy}")
    print(f"  token hit rate:  {r.token_hit_rate:.2%} ({r.hit_tokens:,} of {r.prompt_tokens:,} "
          "prompt tokens)")
    if args.host_blocks:
        _print_tiers(r, args.host_blocks, args.host_policy)
    print(f"  evicted blocks:  {r.evicted_blocks:,}   preemptions: {r.preemptions:,}")
    print(f"  simulated clock: TTFT {r.ttft_ms_p50:,.0f} ms p50, {r.ttft_ms_p99:,.0f} ms p99; "
          f"queueing {r.queue_ms_p50:,.0f} ms p50, {r.queue_ms_p99:,.0f} ms p99; "
          f"{r.output_tokens_per_s:,.0f} output tokens/s")
    print(f"  scheduler+manager CPU: {r.cpu_us_per_step_median:.1f} µs/step median, "
          f"{r.cpu_us_per_step_p99:.1f} µs p99, {r.cpu_s:.2f}s total")
    if "published" in out:
        pub = out["published"]
        how = "bound" if pub["mode"] == "bind" else "connected to"
        print(f"  KV events:       {pub['batches']:,} batches published, {how} {pub['endpoint']}"
              + ("" if pub["peer_connected"] or pub["mode"] == "bind" else " (no peer reached)")
              + (f" ({pub['dropped']:,} dropped: the send queue was full)" if pub["dropped"]
                 else ""))
    if "ideal_hit_rate" in out:
        print(f"  infinite-capacity hit rate: {out['ideal_hit_rate']:.2%}")
    width = max((len(p) for p in out.get("policies", {})), default=0)
    for p, rate in out.get("policies", {}).items():
        skipped = out["policies_skipped"][p]
        print(f"  policy {p:{width}s} hit rate: {rate:.2%}  (same capacity, one request at a time"
              + (f"; {skipped} requests larger than the cache skipped)" if skipped else ")"))
    if "curves" in out:
        policies = list(out["curves"])
        print(f"\n  {'capacity (tokens)':>18} " + " ".join(f"{p:>7}" for p in policies)
              + "  skipped")
        for i, (cap_tokens, _, skipped) in enumerate(out["curves"][policies[0]]):
            rates = [out["curves"][p][i][1] for p in policies]
            print(f"  {cap_tokens:>18,} " + " ".join(
                f"{r:>7.1%}" if r is not None else f"{'-':>7}" for r in rates)
                + f"  {skipped:>7,}")
        print(f"  plot written to {args.plot}")


def _replay_cluster(reqs: list[Any], cfg: Any, args: argparse.Namespace,
                   progress: bool, stop: SigintStop) -> list[Any]:
    """One cluster replay per router named (a Ctrl-C skips the routers not run yet)."""
    from kvcore.sim.cluster import ClusterConfig, ClusterResult, replay_cluster
    from kvcore.sim.replay import progress_bar

    routers = args.router or ["prefix"]
    if "dynamo" in routers:  # before any replay, not after the first one
        from kvcore.cluster.dynamo import require_dynamo

        require_dynamo()
    results: list[ClusterResult] = []
    for name in routers:
        if results and stop.requested:
            break
        cluster = ClusterConfig(args.replicas, name, args.load_weight)
        bar = progress_bar(len(reqs)) if progress else None
        try:
            results.append(replay_cluster(reqs, cfg, cluster, should_stop=stop,
                                          on_finished=bar.update if bar is not None else None))
        finally:
            if bar is not None:
                bar.close()
    return results


def _print_tiers(r: Any, host_blocks: int, host_policy: str) -> None:
    miss = r.prompt_tokens - r.hit_tokens - r.host_hit_tokens
    share = miss / r.prompt_tokens if r.prompt_tokens else 0.0
    where = f" ({host_blocks:,} blocks, {host_policy})" if host_blocks else ""
    print(f"  host tier{where}: {r.host_hit_rate:.2%} of prompt tokens loaded from host "
          f"({r.host_hit_tokens:,}); device {r.token_hit_rate:.2%}; recomputed {share:.2%}")


def _print_cluster(source: str, r: Any, num_blocks: int, block_size: int, policy: str,
                   host_blocks: int, host_policy: str) -> None:
    print(f"replayed {source} on {r.num_replicas} replicas, router {r.router}: "
          f"{r.num_finished} of {r.num_requests} requests finished ({r.num_rejected} rejected), "
          f"{r.wall_s:.2f}s wall")
    print(f"  KV cache:        {num_blocks - 1} blocks x {block_size} tokens per replica; "
          f"eviction {policy}")
    print(f"  token hit rate:  {r.token_hit_rate:.2%} ({r.hit_tokens:,} of {r.prompt_tokens:,} "
          "prompt tokens, all replicas)")
    if host_blocks:
        _print_tiers(r, host_blocks, host_policy)
    print(f"  imbalance:       {r.imbalance:.2f} (busiest replica's busy time / mean)")
    print(f"  TTFT:            {r.ttft_ms_median:,.0f} ms median, {r.ttft_ms_p99:,.0f} ms p99 "
          "(simulated)")
    print(f"  KV events:       {r.event_batches:,} batches, {r.event_bytes:,} bytes; index holds "
          f"{r.index_blocks:,} blocks")
    if r.dynamo is not None:
        from kvcore.sim.cluster_report import dynamo_lines

        print("\n".join(dynamo_lines(r.dynamo)))
    for i, rep in enumerate(r.replicas):
        print(f"  replica {i}: {rep.requests:5,} requests, hit rate {rep.token_hit_rate:6.2%}, "
              f"busy {rep.busy_ms / 1000:,.1f} s, {rep.evicted_blocks:,} evicted")
