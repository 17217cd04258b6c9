"""The ``kvcore`` command line.

    kvcore replay [TRACE] [--workload NAME] [--block-size N] [--num-blocks N | --capacity-tokens N]
                  [--eviction-policy NAME] [--queue-hints DEPTH] [--schedule-policy NAME]
                  [--policy lru,slru,s3fifo,arc,fifo,lfu,belady] [--plot FILE] [--json]
    kvcore bench pool|hash|manager [...]
    kvcore --version                 (and which build: compiled with mypyc, or pure Python)

Bad input (a missing or malformed trace, a negative capacity, an unknown policy) is reported in
one line on stderr with exit status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvcore.cmdline import OneLineParser, non_negative_int, positive_int
from kvcore.errors import InvalidArgumentError, KVCoreError
from kvcore.eviction import OFFLINE_BOUND, RECOMMENDED, RECOMMENDED_NAME, REGISTRY, REUSE_ORACLE
from kvcore.sim.interrupt import INTERRUPTED, SigintStop, partial_note
from kvcore.sim.oracle import REPLAY_ORACLES

DEFAULT_MAX_MODEL_LEN = 1 << 20  # tokens; the shipped Mooncake trace's longest request: 191,386

MAIN_EPILOG = """\
examples:
  kvcore replay                                   built-in shared-prefix workload
  kvcore replay --workload multi-turn --policy lru,belady --plot curve.png
  kvcore replay mooncake-synthetic --block-size 512 \\
      --capacity-tokens 4000000 --policy lru,fifo,lfu,belady      the shipped Mooncake trace
  kvcore replay TRACE.jsonl --block-size 512 --num-blocks 2049 --eviction-policy recommended --json
  kvcore bench manager                            kvcore vs vLLM, same run
"""


def _policies(text: str) -> list[str]:
    names = [p.strip() for p in text.split(",") if p.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"no policy in {text!r}; choose from "
                                         f"{', '.join(REGISTRY.names())}")
    for name in names:
        try:
            REGISTRY.parse(name, offline=True)
        except KVCoreError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return names


def _pool_policy(text: str) -> str:
    """A policy the pool runs, or ``recommended``."""
    if text == RECOMMENDED_NAME:
        return text
    try:
        REGISTRY.parse(text)
    except KVCoreError as exc:
        raise argparse.ArgumentTypeError(f"{exc}, or {RECOMMENDED_NAME}") from None
    return text


def _eviction_policy(text: str) -> str:
    """``--eviction-policy``: a pool policy, ``recommended``, or an offline policy the replay
    runs with the trace's future (``REPLAY_ORACLES``: ``belady``, ``reuse_oracle``)."""
    return text if text in REPLAY_ORACLES else _pool_policy(text)


def _schedule_policy(text: str) -> str:
    from kvcore.schedule_policy import resolve

    try:
        return resolve(text)
    except InvalidArgumentError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _host_policy(text: str) -> str:
    if text == RECOMMENDED_NAME:
        raise argparse.ArgumentTypeError(f"the host tier takes a policy name, one of "
                                         f"{', '.join(REGISTRY.names(offline=False))}")
    return _pool_policy(text)


def _routers(text: str) -> list[str]:
    """``--router``: one router or several, comma separated (each runs the same trace)."""
    from kvcore.cluster.router import ROUTERS

    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"no router in {text!r}; choose from "
                                         f"{', '.join(ROUTERS)}")
    for name in names:
        if name not in ROUTERS:
            raise argparse.ArgumentTypeError(f"unknown router {name!r}; choose from "
                                             f"{', '.join(ROUTERS)}")
    if len(set(names)) < len(names):
        raise argparse.ArgumentTypeError(f"a router is named twice in {text!r}")
    return names


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return value


def version() -> str:
    """``kvcore <version> (compiled with mypyc)`` or ``kvcore <version> (pure Python)``."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    import kvcore

    try:
        number = dist_version("kvcore")
    except PackageNotFoundError:  # a source tree on sys.path, not installed
        number = "(not installed)"
    build = "compiled with mypyc" if kvcore.__compiled__ else "pure Python"
    return f"kvcore {number} ({build})"


def build_parser() -> argparse.ArgumentParser:
    ap = OneLineParser(prog="kvcore", description="kvcore: a vLLM-v1-style KV-cache manager, with "
                 "trace replay, eviction-policy experiments and benchmarks.",
                 epilog=MAIN_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--version", action="version", version=version(),
                    help="print the version and which build this is (compiled or pure Python)")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND", parser_class=OneLineParser)

    rp = sub.add_parser("replay", help="replay a trace or workload through the scheduler and "
                        "KV-cache manager; compare eviction policies",
                        description="Replay a Mooncake trace (JSONL) or a built-in synthetic "
                        "workload through kvcore's scheduler and KV-cache manager (no model), "
                        "and optionally compare eviction policies on the same requests.")
    rp.add_argument("trace", nargs="?", help="Mooncake JSONL trace, or mooncake-synthetic: the "
                    "Mooncake trace shipped with kvcore (kvcore/data/mooncake/; default: a "
                    "built-in workload)")
    rp.add_argument("--workload", default="shared-prefix",
                    help="built-in workload when no TRACE: shared-prefix, multi-turn, few-shot, "
                    "random (sized for the default 16-token blocks), agent (tool-using agent "
                    "sessions, 148M prompt tokens: sized for --block-size 512 and a cache of "
                    "1024-8192 blocks) (default: shared-prefix)")
    rp.add_argument("--block-size", type=positive_int, default=16, help="tokens per block (16)")
    cap = rp.add_mutually_exclusive_group()
    cap.add_argument("--num-blocks", type=positive_int, help="KV-cache blocks (null block included)")
    cap.add_argument("--capacity-tokens", type=positive_int,
                     help="KV-cache capacity in tokens (default: 16384 for a built-in "
                     "workload, 4194304 for a trace)")
    rp.add_argument("--max-num-seqs", type=positive_int, default=64, help="running requests (64)")
    rp.add_argument("--max-num-batched-tokens", type=positive_int, default=8192,
                    help="tokens per step (8192)")
    rp.add_argument("--limit", type=positive_int, help="replay only the first N requests")
    rp.add_argument("--max-model-len", type=positive_int, default=DEFAULT_MAX_MODEL_LEN,
                    metavar="TOKENS", help="the model length: a trace request longer than this "
                    "(prompt + output tokens) is refused, naming its line, before any of its "
                    f"tokens is made (default {DEFAULT_MAX_MODEL_LEN})")
    rp.add_argument("--eviction-policy", type=_eviction_policy, default="lru", metavar="NAME",
                    help="the real pool's eviction policy for the replay: "
                    f"{REGISTRY.describe(offline=False)}; options as slru:protected_share=0.3; "
                    f"or {OFFLINE_BOUND} (offline bound, knows the trace's future), "
                    f"{REUSE_ORACLE} (offline: knows which blocks are needed again), or "
                    f"{RECOMMENDED_NAME} (the README's policy and queue-hint depth: "
                    f"{RECOMMENDED.policy}, {RECOMMENDED.queue_hints}). Default: lru")
    rp.add_argument("--queue-hints", type=non_negative_int, metavar="DEPTH",
                    help="the scheduler declares its first DEPTH waiting requests to the cache "
                    "every step, so their cached prefixes are evicted last (0 = off; default: "
                    "0, or the recommended depth with --eviction-policy recommended)")
    rp.add_argument("--schedule-policy", type=_schedule_policy, default="fcfs", metavar="NAME",
                    help="admission order of waiting requests: fcfs (arrival, the default), lpm "
                    "(longest cached prefix first), dfs-weight (grouped by shared prefix), or "
                    "recommended; non-FCFS orders admit a request waiting over "
                    "--max-waiting-steps first")
    rp.add_argument("--max-waiting-steps", type=positive_int, default=256, metavar="STEPS",
                    help="the starvation bound of non-FCFS orders (default 256 steps)")
    rp.add_argument("--policy", type=_policies,
                    help="also simulate these eviction policies (comma separated) at the same "
                    f"capacity, one request at a time: {REGISTRY.describe()}")
    rp.add_argument("--plot", metavar="FILE", help="write a hit-rate-vs-capacity plot "
                    "(policies from --policy, default lru,belady)")
    rp.add_argument("--publish", metavar="ENDPOINT",
                    help="stream the replay's KV events over ZeroMQ as vLLM publishes them "
                    "(PUB socket; batches are kept for replay requests on --publish-replay). "
                    "Bind or connect, as vLLM does: a wildcard host (tcp://*:5557), ipc:// and "
                    "inproc:// bind, and subscribers connect to them; any other address "
                    "(tcp://127.0.0.1:5557) connects, so a subscriber must bind it. The replay "
                    "says which it did, and warns if a connecting publisher never reached a peer")
    rp.add_argument("--publish-replay", metavar="ENDPOINT",
                    help="ROUTER socket answering replay requests for --publish (e.g. "
                    "tcp://*:5558)")
    rp.add_argument("--host-blocks", type=non_negative_int, default=0, metavar="N",
                    help="a host-memory tier of N blocks behind each device cache (an "
                    "offloading connector: write-through stores, loads before recompute; "
                    "default 0 = none)")
    rp.add_argument("--host-policy", type=_host_policy, default="lru", metavar="NAME",
                    help="the host tier's eviction policy, one of "
                    f"{', '.join(REGISTRY.names(offline=False))} (default lru)")
    rp.add_argument("--host-admit-after", type=positive_int, default=1, metavar="K",
                    help="store a block in the host tier on its K-th offer (default 1)")
    rp.add_argument("--replicas", type=positive_int, default=1, metavar="N",
                    help="replay on N replicas (each with the cache and limits above) behind "
                    "--router, under one simulated clock (default 1)")
    rp.add_argument("--router", type=_routers, default=None, metavar="NAME[,NAME...]",
                    help="how requests are routed to the replicas: prefix (KV-aware, kvcore's "
                    "index of the replicas' KV events; the default with --replicas), "
                    "round-robin, least-loaded, dynamo (NVIDIA Dynamo's KV indexer in its own "
                    "process, fed by real ZeroMQ publishers; needs pip install 'kvcore[dynamo]'). "
                    "Several, comma separated, replay the same trace with each and print them "
                    "side by side")
    rp.add_argument("--load-weight", type=_non_negative_float, default=1.0, metavar="W",
                    help="the prefix router's cost of a pending token relative to a token to "
                    "compute (1.0)")
    rp.add_argument("--json", action="store_true", help="print results as JSON")
    rp.add_argument("--no-progress", action="store_true", help="no progress bar")

    bp = sub.add_parser("bench", help="benchmarks against vLLM (pool, hash, manager)",
                        add_help=False)
    bp.add_argument("args", nargs=argparse.REMAINDER)
    return ap


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
    from kvcore.sim.policies import hit_rate_curve, ideal_hit_rate, to_block_requests
    from kvcore.sim.replay import ReplayConfig, replay

    if args.plot is not None:  # before the run, not after it
        from kvcore.sim.plots import check_plot_path

        check_plot_path(args.plot)
    source, reqs = _load(args)
    capacity = args.capacity_tokens if args.num_blocks is None and args.capacity_tokens else None
    if args.num_blocks is None and capacity is None:
        capacity = 4_194_304 if args.trace is not None else 16_384
    policy, hints = args.eviction_policy, args.queue_hints
    if policy == RECOMMENDED_NAME:
        policy = RECOMMENDED.policy
        hints = RECOMMENDED.queue_hints if hints is None else hints
    progress = not args.no_progress and len(reqs) > 200  # on stderr, also with --json
    cfg = ReplayConfig(block_size=args.block_size, num_blocks=args.num_blocks,
                       capacity_tokens=capacity, max_model_len=args.max_model_len,
                       max_num_seqs=args.max_num_seqs,
                       max_num_batched_tokens=args.max_num_batched_tokens,
                       eviction_policy=policy, queue_hints=hints or 0, progress=progress,
                       host_blocks=args.host_blocks, host_eviction_policy=args.host_policy,
                       host_admit_after=args.host_admit_after,
                       schedule_policy=args.schedule_policy,
                       max_waiting_steps=args.max_waiting_steps)
    num_blocks = cfg.resolve_num_blocks()
    if args.publish_replay is not None and args.publish is None:
        raise InvalidArgumentError("--publish-replay needs --publish")
    clustered = args.replicas > 1 or args.router is not None
    if clustered and args.publish is not None:
        raise InvalidArgumentError("--publish streams one replica's events; it cannot be "
                                   "combined with --replicas/--router")
    stop = SigintStop()  # Ctrl-C: the replay ends at its next step, results marked partial
    if clustered:
        with stop:
            results = _replay_cluster(reqs, cfg, args, progress, stop)
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
    r = result
    print(f"replayed {source}: {r.num_finished} of {len(reqs)} requests finished "
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
    return INTERRUPTED if stop.requested else 0


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


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "bench":
        # Their own parsers own every following argument (argparse.REMAINDER would not take a
        # leading option such as --no-peer).
        args = argparse.Namespace(command=argv[0], args=argv[1:])
    else:
        args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    try:
        if args.command == "replay":
            return cmd_replay(args)
        if args.command == "bench":
            from kvcore.bench.__main__ import main as bench_main

            return bench_main(args.args)
    except (KVCoreError, ValueError, OSError) as exc:
        print(f"kvcore: error: {exc}", file=sys.stderr)
        return 2
    except ImportError as exc:
        print(f"kvcore: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # outside a replay's steps (which stop and report what they did)
        print("kvcore: interrupted", file=sys.stderr)
        return INTERRUPTED
    return 0


if __name__ == "__main__":
    sys.exit(main())
