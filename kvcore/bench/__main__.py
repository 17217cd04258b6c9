"""``python -m kvcore.bench {pool,hash,manager}``: kvcore vs vLLM (and a compiled kvcore, when
given), same workload, same run, in persistent interleaved workers;
``python -m kvcore.bench fuzz``: the long hostile fuzz run (kvcore alone);
``python -m kvcore.bench fuzz --scheduler``: the same for kvcore's scheduler with a failing KV
connector (:mod:`kvcore.bench.scheduler_fuzz`)."""

from __future__ import annotations

import argparse
import json
import platform
import sys
from collections.abc import Sequence

from kvcore.bench.commands import COMMANDS, MIN_REPEATS, list_scenarios
from kvcore.bench.peer import COMPILED_ENV
from kvcore.bench.workers import WorkerError
from kvcore.cmdline import OneLineParser, positive_int


def _common(p: argparse.ArgumentParser, top: bool) -> None:
    """Options accepted before or after the subcommand (after it, absent ones do not override
    what was given before it)."""
    suppress = argparse.SUPPRESS
    p.add_argument("--no-peer", action="store_true", default=False if top else suppress,
                   help="skip the vLLM peer")
    p.add_argument("--json", metavar="FILE", default=None if top else suppress,
                   help="also write every raw sample as JSON")
    p.add_argument("--compiled-python", metavar="PATH", default=None if top else suppress,
                   help="an interpreter whose installed kvcore is the compiled build (adds "
                   f"compiled columns; default ${COMPILED_ENV})")
    p.add_argument("--baseline", metavar="DIR|PYTHON", default=None if top else suppress,
                   help="another kvcore source tree (e.g. `git worktree add /tmp/base HEAD~1`) "
                   "measured in the same run: adds its column and this tree's time relative "
                   "to it; or the interpreter of a venv holding a compiled build of one, "
                   "compared with --compiled-python's")


def build_parser() -> argparse.ArgumentParser:
    ap = OneLineParser(prog="python -m kvcore.bench",
                       description="kvcore benchmarks, with vLLM measured in the same run: one "
                       "persistent worker per implementation, repeats taken in turns.")
    _common(ap, top=True)
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("pool", help="BlockPool ns/block for alloc+free, touch, eviction")
    p.add_argument("--pool-sizes", default="1000,100000,1000000")
    p.add_argument("--batch-sizes", default="1,16,256")
    p.add_argument("--repeats", type=positive_int, default=7)
    _common(p, top=False)
    h = sub.add_parser("hash", help="request block hashing throughput per algorithm")
    h.add_argument("--block-sizes", default="16,256")
    h.add_argument("--num-tokens", type=positive_int, default=1 << 16)
    h.add_argument("--repeats", type=positive_int, default=7)
    _common(h, top=False)
    sub.add_parser("fuzz", help="hostile fuzzing of the manager, or with --scheduler of the "
                   "scheduler (see --help of the command)", add_help=False)
    m = sub.add_parser("manager", help="KVCacheManager CPU µs per request cycle, per scenario")
    m.add_argument("--repeats", type=positive_int, default=MIN_REPEATS,
                   help=f"interleaved repeats per scenario (at least {MIN_REPEATS})")
    m.add_argument("--requests", type=positive_int, default=2000,
                   help="requests per 128-token scenario (long-request scenarios run fewer)")
    m.add_argument("--scenarios", metavar="NAMES",
                   help="comma-separated scenario names or substrings (default: all)")
    m.add_argument("--quick", action="store_true",
                   help=f"smoke run: allow fewer than {MIN_REPEATS} repeats, no warm-up "
                   "(the figures mean little)")
    m.add_argument("--list", action="store_true", help="list the scenarios and exit")
    _common(m, top=False)
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["fuzz"] and "--scheduler" in argv:  # its own parser, as fuzz's
        from kvcore.bench.scheduler_fuzz import main as scheduler_fuzz_main

        return scheduler_fuzz_main([a for a in argv[1:] if a != "--scheduler"])
    if argv[:1] == ["fuzz"]:  # its own parser (no peer: it checks kvcore alone)
        from kvcore.bench.fuzz import main as fuzz_main

        return fuzz_main(argv[1:])
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.command == "manager":
        if args.list:
            list_scenarios()
            return 0
        if args.repeats < MIN_REPEATS and not args.quick:
            ap.error(f"--repeats must be at least {MIN_REPEATS} (use --quick for a smoke run)")
    print(f"# {platform.node()} · {platform.processor() or platform.machine()} · "
          f"Python {platform.python_version()}\n")
    try:
        run = COMMANDS[args.command](args)
    except WorkerError as exc:
        print(f"python -m kvcore.bench: error: {exc}", file=sys.stderr)
        return 1
    except ValueError as exc:  # e.g. --scenarios matching nothing
        print(f"python -m kvcore.bench: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        with open(args.json, "w") as f:
            json.dump(run.to_json(), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
