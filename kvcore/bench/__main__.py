"""``python -m kvcore.bench {pool,hash,manager}``: kvcore vs vLLM, same workload, same run;
``python -m kvcore.bench fuzz``: the long hostile fuzz run (kvcore alone)."""

from __future__ import annotations

import argparse
import json
import platform
import sys
from collections.abc import Callable, Sequence
from typing import Any

from kvcore.bench.peer import WorkloadError, peer_python, run_workload
from kvcore.bench.table import fmt, ratio, render
from kvcore.cmdline import OneLineParser


def _run_pair(script: str, args: list[str], use_peer: bool) -> tuple[Any, Any, str]:
    ours = run_workload(script, "kvcore", args)
    note = ""
    peer: Any = None
    if use_peer:
        py = peer_python()
        if py is None:
            note = ("vLLM peer not found: build it with `bash scripts/peer_vllm.sh` "
                    "or set KVCORE_PEER_PYTHON")
        else:
            try:
                peer = run_workload(script, "vllm", args, python=py)
            except WorkloadError as exc:
                note = f"vLLM peer failed: {exc}"
    return ours, peer, note


def _index(rows: Any, key: Callable[[dict[str, Any]], tuple[Any, ...]]) -> dict[tuple[Any, ...], Any]:
    return {key(r): r for r in rows} if rows else {}


def bench_pool(args: argparse.Namespace) -> dict[str, Any]:
    wl = ["--pool-sizes", args.pool_sizes, "--batch-sizes", args.batch_sizes,
          "--repeats", str(args.repeats)]
    ours, peer, note = _run_pair("pool_ops.py", wl, not args.no_peer)
    key = lambda r: (r["op"], r["pool_size"], r["batch"])  # noqa: E731
    peer_by = _index(peer, key)
    rows = []
    for r in ours:
        p = peer_by.get(key(r))
        pv = p["ns_per_block"] if p else None
        rows.append([r["op"], f"{r['pool_size']:,}", str(r["batch"]), fmt(r["ns_per_block"]),
                     fmt(pv), ratio(r["ns_per_block"], pv)])
    print(render(["op", "pool blocks", "batch", "kvcore ns/block", "vLLM ns/block",
                  "kvcore/vLLM"], rows, title="BlockPool: ns per block (median)"))
    # O(1) evidence: cost at the largest pool relative to the smallest, per op and batch.
    sizes = sorted({r["pool_size"] for r in ours})
    if len(sizes) > 1:
        by = _index(ours, key)
        scale_rows = []
        for op in dict.fromkeys(r["op"] for r in ours):
            for batch in sorted({r["batch"] for r in ours}):
                lo, hi = by.get((op, sizes[0], batch)), by.get((op, sizes[-1], batch))
                if lo and hi:
                    scale_rows.append([op, str(batch), f"{hi['ns_per_block'] / lo['ns_per_block']:.2f}x"])
        print()
        print(render(["op", "batch", f"{sizes[-1]:,} vs {sizes[0]:,} blocks"], scale_rows,
                     title="kvcore scaling with pool size (1.00x = flat)"))
    if note:
        print(f"\nnote: {note}")
    return {"kvcore": ours, "vllm": peer, "note": note}


def bench_hash(args: argparse.Namespace) -> dict[str, Any]:
    wl = ["--block-sizes", args.block_sizes, "--num-tokens", str(args.num_tokens),
          "--repeats", str(args.repeats)]
    ours, peer, note = _run_pair("hash_ops.py", wl, not args.no_peer)
    key = lambda r: (r["algorithm"], r["block_size"])  # noqa: E731
    peer_by = _index(peer, key)
    rows = []
    for r in ours:
        p = peer_by.get(key(r))
        pv = p["tokens_per_s"] if p else None
        rows.append([r["algorithm"], str(r["block_size"]), fmt(r["tokens_per_s"] / 1e6, 2),
                     p["peer_algorithm"] if p else "n/a", fmt(pv / 1e6 if pv else None, 2),
                     ratio(pv, r["tokens_per_s"]) if pv else "n/a"])
    print(render(["algorithm", "block size", "kvcore Mtok/s", "vLLM algo", "vLLM Mtok/s",
                  "kvcore time/vLLM time"], rows,
                 title="Request block hashing: million tokens per second (median)"))
    if note:
        print(f"\nnote: {note}")
    return {"kvcore": ours, "vllm": peer, "note": note}


def bench_manager(args: argparse.Namespace) -> dict[str, Any]:
    wl = ["--repeats", str(args.repeats), "--requests", str(args.requests)]
    ours, peer, note = _run_pair("manager_cycle.py", wl, not args.no_peer)
    key = lambda r: (r["scenario"],)  # noqa: E731
    peer_by = _index(peer, key)
    rows = []
    for r in ours:
        p = peer_by.get(key(r))
        pv = p["us_per_cycle"] if p else None
        rows.append([r["scenario"], fmt(r["us_per_cycle"], 2), fmt(pv, 2),
                     ratio(r["us_per_cycle"], pv)])
    print(render(["scenario", "kvcore µs/cycle", "vLLM µs/cycle", "kvcore/vLLM"], rows,
                 title="KVCacheManager: µs per request cycle (median)"))
    if note:
        print(f"\nnote: {note}")
    return {"kvcore": ours, "vllm": peer, "note": note}


COMMANDS: dict[str, Callable[[argparse.Namespace], dict[str, Any]]] = {
    "pool": bench_pool, "hash": bench_hash, "manager": bench_manager}


def build_parser() -> argparse.ArgumentParser:
    ap = OneLineParser(prog="python -m kvcore.bench",
                                 description="kvcore benchmarks, with vLLM measured in the same run.")
    ap.add_argument("--no-peer", action="store_true", help="skip the vLLM peer")
    ap.add_argument("--json", metavar="FILE", help="also write raw results as JSON")
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("pool", help="BlockPool ns/block for alloc+free, touch, eviction")
    p.add_argument("--pool-sizes", default="1000,100000,1000000")
    p.add_argument("--batch-sizes", default="1,16,256")
    p.add_argument("--repeats", type=int, default=7)
    h = sub.add_parser("hash", help="request block hashing throughput per algorithm")
    h.add_argument("--block-sizes", default="16,256")
    h.add_argument("--num-tokens", type=int, default=1 << 16)
    h.add_argument("--repeats", type=int, default=7)
    sub.add_parser("fuzz", help="hostile fuzzing of the manager (see --help of the command)",
                   add_help=False)
    m = sub.add_parser("manager", help="KVCacheManager µs per request cycle")
    m.add_argument("--repeats", type=int, default=5)
    m.add_argument("--requests", type=int, default=2000)
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["fuzz"]:  # its own parser (no peer: it checks kvcore alone)
        from kvcore.bench.fuzz import main as fuzz_main

        return fuzz_main(argv[1:])
    args = build_parser().parse_args(argv)
    print(f"# {platform.node()} · {platform.processor() or platform.machine()} · "
          f"Python {platform.python_version()}\n")
    result = COMMANDS[args.command](args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
