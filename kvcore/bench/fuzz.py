"""Long hostile fuzzing of the KV-cache manager: ``python -m kvcore.bench fuzz``.

Runs :class:`kvcore.testing.driver.HostileDriver` over every setup of
:data:`~kvcore.testing.setups.SETUPS` (full, sliding window, odd chunk sizes, hybrids, Mamba,
cross attention, EAGLE, caching off, colliding hashers under ``verify_hits``, and the
``mixed-bs`` family: groups of different block sizes crossed with lookahead hashes, sparse
retention and every eviction policy; ``--setup``/``--match`` choose some, ``--per-setup``
prints each one's operations and violations), mixing valid and
hostile calls with parameters from a seeded generator, and checks after every operation:
invariants, the content of every running table and adopted hit (no wrong KV), that refused and
``None`` calls changed nothing, and no leak once idle.  Each setup runs in rounds of
``--round-ops`` operations on a fresh manager (bounded memory), round-robin until ``--ops``
operations are done.  Any violation is reported with the setup, seed, round and operation index
that reproduce it, and the exit status is 1.
"""

from __future__ import annotations

import argparse
import random
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from kvcore.cmdline import OneLineParser
from kvcore.testing.driver import HostileDriver
from kvcore.testing.operations import random_operation
from kvcore.testing.setups import MIXED, SETUPS, Setup


@dataclass
class FuzzReport:
    ops: int = 0
    rounds: int = 0
    seconds: float = 0.0
    counts: Counter[str] = field(default_factory=Counter)
    violations: list[str] = field(default_factory=list)
    setup_ops: Counter[str] = field(default_factory=Counter)  # operations per setup name
    setup_violations: Counter[str] = field(default_factory=Counter)


def run_round(setup: Setup, seed: int, num_ops: int, report: FuzzReport) -> None:
    """``num_ops`` random operations on a fresh manager; a violation is recorded, not raised."""
    rng = random.Random(seed)
    driver = HostileDriver(setup)
    done = 0
    try:
        while done < num_ops:
            random_operation(driver, rng)
            driver.check()
            done += 1
        driver.operation = "drain"
        driver.drain()
    except Exception as exc:
        where = traceback.extract_tb(exc.__traceback__)[-1]
        report.violations.append(
            f"{setup.name!r} seed {seed} op {done} ({driver.operation}): "
            f"{type(exc).__name__}: {exc} [{where.filename.rsplit('/', 1)[-1]}:{where.lineno}]")
        report.setup_violations[setup.name] += 1
        done += 1
    report.ops += done
    report.rounds += 1
    report.counts.update(driver.counts)
    report.setup_ops[setup.name] += done


def fuzz(num_ops: int, seed: int = 0, round_ops: int = 2000,
         setups: tuple[Setup, ...] = SETUPS, progress: bool = False) -> FuzzReport:
    report = FuzzReport()
    start = time.perf_counter()
    bar = _progress(num_ops) if progress else None
    r = 0
    while report.ops < num_ops:
        setup = setups[r % len(setups)]
        done = report.ops
        run_round(setup, seed * 1_000_003 + r, min(round_ops, num_ops - report.ops), report)
        if bar is not None:
            bar.update(report.ops - done)
        r += 1
    if bar is not None:
        bar.close()
    report.seconds = time.perf_counter() - start
    return report


def _progress(total: int) -> Any:
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, unit="op", desc="fuzz")


def main(argv: list[str] | None = None) -> int:
    ap = OneLineParser(prog="python -m kvcore.bench fuzz", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ops", type=int, default=1_000_000, help="operations in all (1,000,000)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--round-ops", type=int, default=2000,
                    help="operations per fresh manager (2,000)")
    ap.add_argument("--setup", action="append", help="only these setups (repeatable)")
    ap.add_argument("--match", action="append",
                    help="only the setups whose name contains this text (repeatable; e.g. "
                         f"{MIXED!r}: different block sizes per group)")
    ap.add_argument("--per-setup", action="store_true",
                    help="print the operations and violations of every setup")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    setups = tuple(s for s in SETUPS
                   if (not args.setup or s.name in args.setup)
                   and (not args.match or any(text in s.name for text in args.match)))
    if not setups:
        ap.error(f"no setup named {args.setup} or matching {args.match}; choose from: "
                 f"{', '.join(s.name for s in SETUPS)}")
    report = fuzz(args.ops, args.seed, args.round_ops, setups, progress=not args.no_progress)
    print(f"{report.ops:,} operations in {report.rounds} rounds over {len(setups)} setups, "
          f"{report.seconds:.0f} s ({report.ops / report.seconds:,.0f} ops/s), "
          f"seed {args.seed}: {len(report.violations)} violations")
    refused = sum(v for k, v in report.counts.items() if k.startswith("refused"))
    print(f"  hostile calls refused with nothing changed: {refused:,}; admissions: "
          f"{report.counts['admit']:,}; hit tokens adopted and proven: "
          f"{report.counts['hit tokens']:,}")
    for name, n in sorted(report.counts.items()):
        print(f"  {name:40s} {n:>12,}")
    if args.per_setup:
        width = max(len(s.name) for s in setups)
        print(f"  {'setup':{width}s} {'operations':>10s} {'violations':>10s}")
        for s in setups:
            print(f"  {s.name:{width}s} {report.setup_ops[s.name]:>10,} "
                  f"{report.setup_violations[s.name]:>10,}")
    for v in report.violations[:20]:
        print(f"VIOLATION {v}")
    return 1 if report.violations else 0
