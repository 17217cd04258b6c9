"""The reference continuous-batching scheduler over :class:`~kvcore.manager.KVCacheManager`.

* :mod:`kvcore.scheduler.core`: :class:`Scheduler` (chunked prefill, recompute preemption,
  async scheduling, the KV connector's side) and :func:`holds_place`;
* :mod:`kvcore.scheduler.types`: the data of one step (:class:`SchedulerConfig`,
  :class:`ScheduledRequest`, :class:`SchedulerOutput`, :class:`SchedulerStats`) and
  :class:`RequestRejectedError`;
* :mod:`kvcore.scheduler.admission`: the admission order of waiting requests
  (``SchedulerConfig.schedule_policy``: ``fcfs``, ``lpm``, ``dfs-weight``, ``recommended``).
"""

from kvcore.scheduler.core import Scheduler, holds_place
from kvcore.scheduler.types import (
    RequestRejectedError,
    ScheduledRequest,
    SchedulerConfig,
    SchedulerOutput,
    SchedulerStats,
)

__all__ = ["RequestRejectedError", "ScheduledRequest", "Scheduler", "SchedulerConfig",
           "SchedulerOutput", "SchedulerStats", "holds_place"]
