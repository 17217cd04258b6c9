"""The ``kvcore`` command line.

    kvcore replay [TRACE] [--workload NAME] [--block-size N] [--num-blocks N | --capacity-tokens N]
                  [--eviction-policy NAME] [--queue-hints DEPTH] [--schedule-policy NAME]
                  [--policy lru,slru,s3fifo,arc,fifo,lfu,belady] [--plot FILE] [--json]
    kvcore bench pool|hash|manager [...]
    kvcore --version                 (and which build: compiled with mypyc, or pure Python)

Bad input (a missing or malformed trace, a negative capacity, an unknown policy) is reported in
one line on stderr with exit status 2.  This module holds the parser and :func:`main`;
``kvcore replay`` is in :mod:`kvcore.cli.replay`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from kvcore.cli.replay import cmd_replay
from kvcore.cmdline import OneLineParser, non_negative_int, positive_int
from kvcore.errors import InvalidArgumentError, KVCoreError
from kvcore.eviction import OFFLINE_BOUND, RECOMMENDED, RECOMMENDED_NAME, REGISTRY, REUSE_ORACLE
from kvcore.sim.interrupt import INTERRUPTED
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
    from kvcore.scheduler.admission import resolve

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
