"""How a workload times its region: thread CPU time with the cyclic GC off.

A :func:`cpu_timed` sample is the thread's CPU time (``time.thread_time_ns``) around one call,
after a ``gc.collect()`` and with the collector disabled during the call, so neither another
process on a shared machine nor a collection triggered by earlier garbage lands in the figure.
Wall time is recorded beside it for reference.  Reading the thread CPU clock is a system call
(about 1.5 µs here), so it is used around whole timed regions only, never per operation.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from typing import Any

Sample = dict[str, Any]
"""``{"ns", "clock", "wall_ns", "units", "info"}``: ``ns`` is the measured figure for ``units``
units of work on ``clock`` ("thread_cpu" or "wall"); ``info`` is what the run did (counts that
must agree between implementations doing the same work).  A case the implementation cannot run
is answered :func:`skipped_sample` instead: ``{"skipped": reason}``."""


def cpu_timed(run: Callable[[], dict[str, Any] | None], units: float) -> Sample:
    """Time ``run()`` (returning its ``info`` dict or None) in thread CPU time, GC off."""
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        w0 = time.perf_counter_ns()
        c0 = time.thread_time_ns()
        info = run()
        c1 = time.thread_time_ns()
        w1 = time.perf_counter_ns()
    finally:
        if was_enabled:
            gc.enable()
    return {"ns": c1 - c0, "clock": "thread_cpu", "wall_ns": w1 - w0, "units": units,
            "info": info or {}}


def wall_sample(ns: int, units: float, info: dict[str, Any] | None = None) -> Sample:
    """A sample a workload timed itself in wall-clock sections (too short for the CPU clock)."""
    return {"ns": ns, "clock": "wall", "wall_ns": ns, "units": units, "info": info or {}}


def skipped_sample(reason: str) -> Sample:
    """The answer for a case this implementation cannot run (the driver stops asking it)."""
    return {"skipped": reason}
