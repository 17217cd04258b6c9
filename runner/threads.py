"""How many threads torch's CPU kernels use in the engine.

torch starts with one intra-op thread per core.  On a machine whose cores are busy with other
work those threads wait on each other: ``python -m runner.generate`` ran its 96 tokens in 0.69 s
with torch's two threads on a loaded 2-core machine and in 0.11 s with one (17 s against 0.22 s
when it was first reported, on a busier one).  So, unless told
otherwise, a CPU engine uses the cores this process may run on that are not already busy (the
1-minute load average), shared among its tensor-parallel ranks, and at least one thread.

An explicit setting wins: ``EngineConfig.cpu_threads`` (``--threads``), or else the
``OMP_NUM_THREADS`` environment variable (which torch itself reads at start; the engine then
leaves the thread count alone).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

import torch

_log = logging.getLogger(__name__)


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask where the OS has one)."""
    affinity = getattr(os, "sched_getaffinity", None)
    if affinity is not None:
        return max(1, len(affinity(0)))
    return max(1, os.cpu_count() or 1)


def busy_cpus() -> float:
    """Cores busy with other work: the 1-minute load average (0 where the OS has none)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return 0.0


def auto_cpu_threads(cpus: int, load: float, world_size: int = 1) -> int:
    """Threads per rank for ``cpus`` usable cores with ``load`` of them busy, shared by
    ``world_size`` ranks: the idle cores' share, at most the cores' share, at least one."""
    idle = cpus - int(load + 0.5)
    return max(1, min(cpus // world_size, idle // world_size))


def resolve_cpu_threads(requested: int | None, world_size: int = 1, *,
                        env: Mapping[str, str] | None = None) -> int | None:
    """The thread count a CPU rank should set: ``requested`` if given; ``None`` (leave torch
    alone) when ``OMP_NUM_THREADS`` is set; otherwise :func:`auto_cpu_threads` now."""
    if requested is not None:
        return requested
    if (env if env is not None else os.environ).get("OMP_NUM_THREADS", "").strip():
        return None
    return auto_cpu_threads(usable_cpus(), busy_cpus(), world_size)


def apply_cpu_threads(threads: int | None) -> None:
    """Set torch's intra-op thread count (``None``: leave it as it is)."""
    if threads is not None and threads != torch.get_num_threads():
        _log.info("using %d CPU thread(s) (was %d)", threads, torch.get_num_threads())
        torch.set_num_threads(threads)
