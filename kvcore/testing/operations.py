"""Random operations for :class:`~kvcore.testing.driver.HostileDriver`: what the long fuzz run
(``python -m kvcore.bench fuzz``) draws, valid ones weighted so that requests keep flowing
through a small pool and every hostile one among them."""

from __future__ import annotations

import itertools
import random

from kvcore.testing.driver import PERTURBATIONS, VOCAB, HostileDriver

OPERATIONS = ("add", "admit", "step", "free", "defer_free", "return_withheld", "finish_load",
              "fail_step", "new_step", "evict", "reset", "bad_count", "use_freed",
              "claim_without_blocks", "foreign_hit", "stale_hit", "duplicate_id", "overrun",
              "null_where_needed", "hit_while_running", "bad_calls", "perturbed_hit",
              "return_twice")


_WEIGHTS = {"add": 10, "admit": 16, "step": 24, "free": 6, "defer_free": 2, "return_withheld": 3,
            "finish_load": 3, "fail_step": 3, "new_step": 3, "evict": 2,
            "reset": 1}  # every hostile operation: 1
_CUM_WEIGHTS = list(itertools.accumulate(_WEIGHTS.get(op, 1) for op in OPERATIONS))


def random_operation(driver: HostileDriver, rng: random.Random) -> str:
    """Apply one operation with parameters drawn from ``rng`` (valid operations weighted so that
    requests keep flowing through a small pool); returns its name, also left in
    ``driver.operation`` (a violation it raises is reported under its name)."""
    r = rng.randrange
    op = rng.choices(OPERATIONS, cum_weights=_CUM_WEIGHTS)[0]
    if op == "add" and len(driver.waiting) >= 6:
        op = "admit"
    driver.operation = op
    if op == "add":
        driver.add(r(3), r(41), [r(VOCAB) for _ in range(r(1, 24))], r(4), r(4), r(5) == 0)
    elif op == "admit":
        driver.admit(r(100), r(1, 40), r(8) if r(4) == 0 else 0, r(3) if r(5) == 0 else 0,
                     r(2) == 0)
    elif op == "step":
        driver.step(r(100), r(1, 16), r(VOCAB), r(3) if r(6) == 0 else 0)
    elif op in ("free", "defer_free"):
        getattr(driver, op)(r(100), r(2) == 0)
    elif op in ("finish_load", "use_freed", "foreign_hit", "stale_hit", "duplicate_id",
                "null_where_needed", "hit_while_running", "bad_calls", "return_withheld",
                "return_twice"):
        getattr(driver, op)(r(100))
    elif op in ("fail_step", "new_step", "reset"):
        getattr(driver, op)()
    elif op == "evict":
        driver.evict([r(100) for _ in range(r(1, 4))])
    elif op == "bad_count":
        driver.bad_count(r(100), r(5), r(5))
    elif op == "claim_without_blocks":
        driver.claim_without_blocks(r(100), r(3))
    elif op == "overrun":
        driver.overrun(r(100), r(4))
    else:
        driver.perturbed_hit(r(100), r(100), r(len(PERTURBATIONS)), r(100))
    return op
