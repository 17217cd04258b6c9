"""Eviction-policy study: the scheduler replay over a grid of cache sizes × configurations.

    python -m kvcore.sim.study mooncake-synthetic --block-size 512 \\
        --blocks 1024,2048,4096,8192 \\
        --configs lru,slru,learned,lru+128,slru+128,learned+128,belady,reuse_oracle

A configuration is ``POLICY``, ``POLICY+DEPTH`` (queue hints: the scheduler declares its first
DEPTH waiting requests), and either with ``@ORDER``, the schedule policy (``lru@lpm``,
``slru+64@dfs-weight``; default ``fcfs``, see :mod:`kvcore.scheduler.admission`).  Every cell is a full replay through the real scheduler and pool
(:func:`kvcore.sim.replay.replay`), run in parallel worker processes.  The table gives each
configuration's token hit rate and, when ``lru`` and ``belady`` (the offline bound) are in the
grid, the fraction of the LRU→Belady gap it closes: ``(rate - lru) / (belady - lru)`` (both in
arrival order: Belady is the bound for FCFS); a second table gives each cell's TTFT p50/p99 on
the simulated clock, and ``--json`` adds queueing delay and throughput.  Without TRACE,
``--workload`` names a built-in workload.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from kvcore.cmdline import OneLineParser, positive_int
from kvcore.errors import InvalidArgumentError
from kvcore.eviction import OFFLINE_BOUND
from kvcore.scheduler.admission import resolve as resolve_schedule_policy
from kvcore.sim.replay import ReplayConfig, replay
from kvcore.sim.traces import TraceRequest


def parse_config(text: str) -> tuple[str, int, str]:
    """``"slru+64@lpm"`` → ("slru", 64, "lpm"); ``"lru"`` → ("lru", 0, "fcfs")."""
    head, at, order = text.partition("@")
    policy, plus, depth = head.partition("+")
    if plus and (not depth.isdigit()):
        raise argparse.ArgumentTypeError(
            f"bad configuration {text!r}: use POLICY, POLICY+DEPTH, either with @ORDER")
    if at:
        try:
            order = resolve_schedule_policy(order)
        except InvalidArgumentError as exc:
            raise argparse.ArgumentTypeError(f"bad configuration {text!r}: {exc}") from None
    return policy, int(depth) if plus else 0, order if at else "fcfs"


def _load(trace: str | None, workload: str, seed: int | None = None,
          head: float = 1.0) -> list[TraceRequest]:
    """The requests: the trace, or the built-in workload drawn with ``seed`` (its default when
    ``None``); ``head`` < 1 keeps that share of them, the earliest by arrival (a development
    split: tune on the first part, evaluate on the whole)."""
    from kvcore.sim import traces, workloads

    if trace:
        reqs = traces.load_mooncake(trace)
    else:
        reqs = workloads.make_workload(workload, **({} if seed is None else {"seed": seed}))
    if head < 1.0:
        reqs = sorted(reqs, key=lambda r: r.arrival_ms)[:int(len(reqs) * head)]
    return reqs


METRICS = ("token_hit_rate", "ttft_ms_p50", "ttft_ms_p99", "queue_ms_p50", "queue_ms_p99",
           "queue_ms_mean", "output_tokens_per_s", "sim_time_ms", "preemptions")


def _cell(args: tuple[str | None, str, int, int, tuple[str, int, str], int, float, int,
                     int | None, float]) -> dict[str, float]:
    (trace, workload, block_size, num_blocks, config, max_num_seqs, time_scale, bound, seed,
     head) = args
    policy, depth, order = config
    reqs = _load(trace, workload, seed, head)
    cfg = ReplayConfig(block_size=block_size, num_blocks=num_blocks + 1,
                       max_num_seqs=max_num_seqs, eviction_policy=policy, queue_hints=depth,
                       schedule_policy=order, time_scale=time_scale, max_waiting_steps=bound)
    result = replay(reqs, cfg).to_dict()
    return {m: result[m] for m in METRICS}


MIN_GAP = 0.005
"""A gap between LRU and Belady under half a point of hit rate is not divided (its share would
be noise)."""


def gap_closed(rate: float, lru: float, belady: float) -> float | None:
    """The fraction of the LRU→Belady gap ``rate`` closes (``None`` when there is no gap of at
    least :data:`MIN_GAP`)."""
    return (rate - lru) / (belady - lru) if belady - lru >= MIN_GAP else None


def main(argv: Sequence[str] | None = None) -> int:
    ap = OneLineParser(prog="python -m kvcore.sim.study", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace", nargs="?", help="Mooncake JSONL trace, or mooncake-synthetic (the "
                    "shipped one; default: --workload)")
    ap.add_argument("--workload", default="multi-turn", help="built-in workload without TRACE")
    ap.add_argument("--block-size", type=positive_int, default=16)
    ap.add_argument("--blocks", default="256,512,1024,2048",
                    help="cache sizes in blocks, comma separated")
    ap.add_argument("--configs",
                    default="lru,slru,learned,lru+128,slru+128,learned+128,belady,reuse_oracle",
                    help="POLICY or POLICY+DEPTH, comma separated")
    ap.add_argument("--max-num-seqs", type=positive_int, default=64)
    ap.add_argument("--time-scale", type=float, default=1.0,
                    help="arrival times are multiplied by this (< 1 loads the scheduler more)")
    ap.add_argument("--max-waiting-steps", type=positive_int, default=256,
                    help="starvation bound of the non-FCFS orders")
    ap.add_argument("--seed", type=int, default=None,
                    help="draw the built-in workload with this seed (default: its own, 0)")
    ap.add_argument("--head", type=float, default=1.0,
                    help="replay only this share of the requests, the earliest by arrival "
                    "(0.5: the first half)")
    ap.add_argument("--workers", type=positive_int, default=2)
    ap.add_argument("--json", metavar="FILE", help="also write the grid as JSON")
    args = ap.parse_args(argv)
    if not 0.0 < args.head <= 1.0:
        ap.error(f"--head must be in (0, 1], got {args.head}")
    sizes = [positive_int(x) for x in args.blocks.split(",")]
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    parsed = [parse_config(c) for c in configs]
    jobs = [(args.trace, args.workload, args.block_size, n, c, args.max_num_seqs,
             args.time_scale, args.max_waiting_steps, args.seed, args.head)
            for n in sizes for c in parsed]
    with ProcessPoolExecutor(args.workers) as pool:
        results = list(pool.map(_cell, jobs))
    full: dict[int, dict[str, dict[str, float]]] = {n: {} for n in sizes}
    for job, config, cell in zip(jobs, configs * len(sizes), results):
        full[job[3]][config] = cell
    grid = {n: {c: m["token_hit_rate"] for c, m in row.items()} for n, row in full.items()}
    source = args.trace or f"workload:{args.workload}" + (
        f" (seed {args.seed})" if args.seed is not None else "")
    if args.head < 1.0:
        source += f", the first {args.head:.0%} by arrival"
    print(f"token hit rate, scheduler replay of {source} ({args.block_size}-token blocks, "
          f"{args.max_num_seqs} running requests); in brackets: share of the LRU→{OFFLINE_BOUND}"
          " gap closed\n")
    print("| blocks | " + " | ".join(configs) + " |")
    print("| ---: | " + " | ".join("---:" for _ in configs) + " |")
    out: dict[str, Any] = {"source": source, "block_size": args.block_size,
                           "time_scale": args.time_scale, "grid": {}, "metrics": full}
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
    print("\nTTFT p50 / p99 (ms, simulated clock)\n")
    print("| blocks | " + " | ".join(configs) + " |")
    print("| ---: | " + " | ".join("---:" for _ in configs) + " |")
    for n in sizes:
        print(f"| {n:,} | " + " | ".join(
            f"{full[n][c]['ttft_ms_p50']:,.0f} / {full[n][c]['ttft_ms_p99']:,.0f}"
            for c in configs) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
