"""Eviction-policy study: the scheduler replay over a grid of cache sizes × configurations.

    python -m kvcore.sim.study mooncake-synthetic --block-size 512 \\
        --blocks 1024,2048,4096,8192 --configs lru,slru,s3fifo,lru+64,slru+64,s3fifo+64,belady

A configuration is ``POLICY`` or ``POLICY+DEPTH`` (queue hints: the scheduler declares its first
DEPTH waiting requests).  Every cell is a full replay through the real scheduler and pool
(:func:`kvcore.sim.replay.replay`), run in parallel worker processes.  The table gives each
configuration's token hit rate and, when ``lru`` and ``belady`` (the offline bound) are in the
grid, the fraction of the LRU→Belady gap it closes: ``(rate - lru) / (belady - lru)``.  Without
TRACE, ``--workload`` names a built-in workload.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from kvcore.cmdline import OneLineParser, positive_int
from kvcore.eviction import OFFLINE_BOUND
from kvcore.sim.replay import ReplayConfig, replay
from kvcore.sim.traces import TraceRequest


def parse_config(text: str) -> tuple[str, int]:
    """``"slru+64"`` → ("slru", 64); ``"lru"`` → ("lru", 0)."""
    policy, plus, depth = text.partition("+")
    if plus and (not depth.isdigit()):
        raise argparse.ArgumentTypeError(f"bad configuration {text!r}: use POLICY or POLICY+DEPTH")
    return policy, int(depth) if plus else 0


def _load(trace: str | None, workload: str) -> list[TraceRequest]:
    from kvcore.sim import traces, workloads

    return traces.load_mooncake(trace) if trace else workloads.make_workload(workload)


def _cell(args: tuple[str | None, str, int, int, str, int, int]) -> float:
    trace, workload, block_size, num_blocks, policy, depth, max_num_seqs = args
    reqs = _load(trace, workload)
    cfg = ReplayConfig(block_size=block_size, num_blocks=num_blocks + 1,
                       max_num_seqs=max_num_seqs, eviction_policy=policy, queue_hints=depth)
    return replay(reqs, cfg).token_hit_rate


def gap_closed(rate: float, lru: float, belady: float) -> float | None:
    """The fraction of the LRU→Belady gap ``rate`` closes (``None`` when there is no gap)."""
    return (rate - lru) / (belady - lru) if belady > lru else None


def main(argv: Sequence[str] | None = None) -> int:
    ap = OneLineParser(prog="python -m kvcore.sim.study", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace", nargs="?", help="Mooncake JSONL trace, or mooncake-synthetic (the "
                    "shipped one; default: --workload)")
    ap.add_argument("--workload", default="multi-turn", help="built-in workload without TRACE")
    ap.add_argument("--block-size", type=positive_int, default=16)
    ap.add_argument("--blocks", default="256,512,1024,2048",
                    help="cache sizes in blocks, comma separated")
    ap.add_argument("--configs", default="lru,slru,s3fifo,lru+64,slru+64,s3fifo+64,belady",
                    help="POLICY or POLICY+DEPTH, comma separated")
    ap.add_argument("--max-num-seqs", type=positive_int, default=64)
    ap.add_argument("--workers", type=positive_int, default=2)
    ap.add_argument("--json", metavar="FILE", help="also write the grid as JSON")
    args = ap.parse_args(argv)
    sizes = [positive_int(x) for x in args.blocks.split(",")]
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    parsed = [parse_config(c) for c in configs]
    jobs = [(args.trace, args.workload, args.block_size, n, p, d, args.max_num_seqs)
            for n in sizes for p, d in parsed]
    with ProcessPoolExecutor(args.workers) as pool:
        rates = list(pool.map(_cell, jobs))
    grid: dict[int, dict[str, float]] = {n: {} for n in sizes}
    for (_, _, _, n, _, _, _), config, rate in zip(jobs, configs * len(sizes), rates):
        grid[n][config] = rate
    source = args.trace or f"workload:{args.workload}"
    print(f"token hit rate, scheduler replay of {source} ({args.block_size}-token blocks, "
          f"{args.max_num_seqs} running requests); in brackets: share of the LRU→{OFFLINE_BOUND}"
          " gap closed\n")
    print("| blocks | " + " | ".join(configs) + " |")
    print("| ---: | " + " | ".join("---:" for _ in configs) + " |")
    out: dict[str, Any] = {"source": source, "block_size": args.block_size, "grid": {}}
    for n in sizes:
        row = grid[n]
        cells = []
        for c in configs:
            closed = (gap_closed(row[c], row["lru"], row[OFFLINE_BOUND])
                      if "lru" in row and OFFLINE_BOUND in row and c not in ("lru", OFFLINE_BOUND)
                      else None)
            cells.append(f"{row[c]:.1%}" + (f" ({closed:+.0%})" if closed is not None else ""))
        print(f"| {n:,} | " + " | ".join(cells) + " |")
        out["grid"][n] = row
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
