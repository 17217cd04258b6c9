"""Cache-aware admission inside vLLM: kvcore's waiting-queue orders for vLLM's scheduler.

``additional_config={"kvcore": {"schedule_policy": "lpm"}}`` (or ``"dfs-weight"``,
``"recommended"``) replaces vLLM's FCFS waiting queue with a :class:`CacheAwareQueue`, which the
kvcore scheduler mix-in reorders once at the start of every ``schedule()`` call with
:class:`kvcore.scheduler.admission.WaitingOrder`, the order kvcore's own scheduler uses:

* ``lpm``: longest cached prefix first, the estimates refreshed by at most
  ``lpm_lookups_per_step`` lookups a step (:meth:`KVCacheManagerAdapter.cached_prefix_tokens`:
  no stats, no events, no references);
* ``dfs-weight``: grouped by shared prefix over the waiting requests' own block hashes;
* the starvation guard: a request waiting more than ``max_waiting_steps`` steps goes ahead of
  every fresh request that has not.

Everything else about the queue is vLLM's ``FCFSRequestQueue`` (its subclass): what vLLM's
scheduler does with it — peek, pop, prepend the requests it skipped or preempted, add, remove,
iterate — behaves exactly as in vLLM between two reorders.  Only fresh requests move: a request
that is not ``WAITING`` (preempted, blocked on a grammar, a KV load or streaming input) or holds
computed tokens or a token in flight keeps its place at the head, in vLLM's order.  Requests
holding KV blocks sit in vLLM's separate ``kv_holding_waiting`` queue, drained first and never
reordered.  The queue hints (``queue_hints``) are declared after the reorder, so they follow it.

vLLM's ``priority`` scheduling policy is refused with a non-FCFS order (at start): its heap
orders by priority and arrival, and a cache-aware order inside one priority level would change
which of two equal-priority requests vLLM preempts.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.core.sched.request_queue import FCFSRequestQueue
from vllm.v1.request import Request, RequestStatus

from kvcore.integrations.vllm.settings import KvcoreSettings
from kvcore.scheduler.admission import FCFS, WaitingOrder


def holds_place(request: Request) -> bool:
    """A waiting request vLLM must find where it put it: not fresh (preempted, blocked), or
    holding computed tokens or a token in flight."""
    return (request.status != RequestStatus.WAITING or request.num_computed_tokens > 0
            or request.num_output_placeholders > 0)


class CacheAwareQueue(FCFSRequestQueue):
    """vLLM's FCFS waiting queue, put in a kvcore admission order by :meth:`reorder`."""

    def __init__(self, manager: Any, settings: KvcoreSettings) -> None:
        super().__init__()
        self.order: WaitingOrder[Request] = WaitingOrder(
            settings, manager.cached_prefix_tokens, holds_place)
        self.steps = 0  # reorders so far: the order's step clock

    def reorder(self) -> None:
        """Reorder the fresh requests for the step about to be scheduled."""
        self.order.reorder(self, self.steps)
        self.steps += 1


def make_queue(manager: Any, settings: KvcoreSettings) -> CacheAwareQueue | None:
    """The waiting queue ``settings`` ask for, or ``None`` for vLLM's own (``fcfs``)."""
    if settings.schedule_policy == FCFS:
        return None
    return CacheAwareQueue(manager, settings)
