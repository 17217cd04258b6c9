"""Long fuzzing of kvcore's scheduler with a failing KV connector:
``python -m kvcore.bench fuzz --scheduler``.

Runs :class:`kvcore.testing.scheduler_driver.SchedulerDriver` over every setup of
:data:`~kvcore.testing.scheduler_driver.SCHEDULER_SETUPS` (every group type — full, sliding
window, chunked local, Mamba in both modes, cross attention, hybrids, caching off,
``verify_hits`` — under every admission policy: fcfs, lpm, dfs-weight): requests submitted,
submitted again under used ids, aborted; steps that run and steps that fail; a connector whose
synchronous and asynchronous loads fail in random blocks and whose stores delay frees.  After
every operation: the checked manager's invariants and content oracle (every adopted hit and
running table holds the request's own KV), the driver's checks (no aborted or finished request
scheduled, no failed block cached or counted as computed, ids refused exactly while in use);
each round ends with a drain (every accepted request finished with its tokens, nothing held or
leaked).  Each setup runs in rounds of ``--round-ops`` operations on a fresh scheduler,
round-robin until ``--ops`` operations are done.  A violation is reported with the setup, seed,
round and operation index that reproduce it, and the exit status is 1.
"""

from __future__ import annotations

import argparse
import time
import traceback
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvcore.cmdline import OneLineParser
from kvcore.testing.scheduler_driver import (
    SCHEDULER_SETUPS,
    SchedulerDriver,
    SchedulerSetup,
    random_operation,
)


@dataclass
class SchedulerFuzzReport:
    ops: int = 0
    rounds: int = 0
    seconds: float = 0.0
    counts: Counter[str] = field(default_factory=Counter)
    violations: list[str] = field(default_factory=list)
    per_setup: Counter[str] = field(default_factory=Counter)  # operations by setup name


def run_round(ssetup: SchedulerSetup, seed: int, num_ops: int,
              report: SchedulerFuzzReport) -> None:
    """``num_ops`` random operations on a fresh scheduler, then a drain; a violation is
    recorded, not raised."""
    driver = SchedulerDriver(ssetup, seed)
    done, op = 0, "start"
    try:
        while done < num_ops:
            op = random_operation(driver)
            done += 1
        op = "drain"
        driver.drain()
    except Exception as exc:
        where = traceback.extract_tb(exc.__traceback__)[-1]
        report.violations.append(
            f"{ssetup.name!r} seed {seed} op {done} ({op}): {type(exc).__name__}: {exc} "
            f"[{where.filename.rsplit('/', 1)[-1]}:{where.lineno}]")
        done += 1
    report.ops += done
    report.rounds += 1
    report.per_setup[ssetup.name] += done
    report.counts.update(driver.counts)


def fuzz(num_ops: int, seed: int = 0, round_ops: int = 2000,
         setups: Sequence[SchedulerSetup] = SCHEDULER_SETUPS) -> SchedulerFuzzReport:
    report = SchedulerFuzzReport()
    start = time.perf_counter()
    r = 0
    while report.ops < num_ops:
        run_round(setups[r % len(setups)], seed * 1_000_003 + r,
                  min(round_ops, num_ops - report.ops), report)
        r += 1
    report.seconds = time.perf_counter() - start
    return report


def main(argv: list[str] | None = None) -> int:
    ap = OneLineParser(prog="python -m kvcore.bench fuzz --scheduler", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ops", type=int, default=1_000_000, help="operations in all (1,000,000)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--round-ops", type=int, default=2000,
                    help="operations per fresh scheduler (2,000)")
    ap.add_argument("--setup", action="append", help="only these setups (repeatable)")
    args = ap.parse_args(argv)
    setups = (SCHEDULER_SETUPS if not args.setup
              else tuple(s for s in SCHEDULER_SETUPS if s.name in args.setup))
    if not setups:
        ap.error(f"no setup named {args.setup}; choose from: "
                 f"{', '.join(s.name for s in SCHEDULER_SETUPS)}")
    report = fuzz(args.ops, args.seed, args.round_ops, setups)
    c = report.counts
    print(f"{report.ops:,} operations in {report.rounds} rounds over {len(setups)} setups, "
          f"{report.seconds:.0f} s ({report.ops / report.seconds:,.0f} ops/s), "
          f"seed {args.seed}: {len(report.violations)} violations")
    print(f"  requests finished: {c['finished']:,}; failed loads (sync, async): "
          f"{c['failed loads (sync)']:,}, {c['failed loads (async)']:,}; ids used again: "
          f"{c['resubmit'] - c['resubmission refused']:,} accepted, "
          f"{c['resubmission refused']:,} refused")
    for name, n in sorted(c.items()):
        print(f"  {name:40s} {n:>12,}")
    print("  operations per setup:")
    for name, n in report.per_setup.items():
        print(f"    {name:38s} {n:>12,}")
    for v in report.violations[:20]:
        print(f"VIOLATION {v}")
    return 1 if report.violations else 0
