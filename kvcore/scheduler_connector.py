"""The scheduler's side of a KV connector: applying what the workers report (finished loads and
stores, failed loads) and keeping loaded requests from blocking admission forever.

:class:`ConnectorSteps` is a base class of :class:`~kvcore.scheduler.Scheduler`; the
connector's protocol is in :mod:`kvcore.connector.base`.
"""

from __future__ import annotations

from collections import deque

from kvcore.connector.base import KVConnectorBase, KVConnectorOutput
from kvcore.manager import KVCacheManager
from kvcore.request import Request, RequestStatus
from kvcore.scheduling import ScheduledRequest, SchedulerStats


class ConnectorSteps:
    """The scheduler state the connector steps read (set by ``Scheduler.__init__``)."""

    kv: KVCacheManager
    connector: KVConnectorBase | None
    stats: SchedulerStats
    waiting: deque[Request]
    running: list[Request]
    loading: dict[str, Request]
    _load_target: dict[str, int]
    _delayed_free: dict[str, Request]

    def _apply_connector_output(self, out: KVConnectorOutput) -> set[str]:
        """Apply what the workers finished; returns the running requests whose KV a failed
        synchronous load left unwritten (they recompute it: no token is taken from this step)."""
        assert self.connector is not None
        self.connector.update_connector_output(out)
        failed = out.invalid_block_ids
        kv = self.kv
        # Deterministic orders (the output holds sets): loads in admission order, resumed
        # requests back at the front of the queue in that order; frees in finishing order.
        recving = out.finished_recving
        resumed: list[Request] = []
        for rid in [r for r in self.loading if r in recving]:
            req = self.loading.pop(rid)
            target = self._load_target.pop(rid)
            if failed and any(b in failed for ids in kv.get_block_ids(rid) for b in ids):
                # Start over: its device hit is still cached (admission hits it again), the
                # blocks the load was to fill were never cached.
                self.stats.load_failures += 1
                self.stats.external_hit_tokens -= target - req.num_computed_tokens
                kv.free(req)
                req.num_computed_tokens = req.num_cached_tokens = 0
            else:
                kv.cache_blocks(req, target)
                req.num_computed_tokens = req.num_cached_tokens = target
            req.status = RequestStatus.WAITING
            resumed.append(req)
        self.waiting.extendleft(reversed(resumed))
        # Finished requests whose loads (aborted) or stores completed.
        for rid in [r for r in self._delayed_free
                    if r in out.finished_sending or r in recving]:
            kv.free(self._delayed_free.pop(rid))
        recomputing: set[str] = set()
        if failed:
            sizes = [g.spec.block_size for g in kv.config.groups]
            for req in self.running:
                for bs, ids in zip(sizes, kv.get_block_ids(req.request_id)):
                    bad = next((i for i, b in enumerate(ids) if b in failed), None)
                    if bad is None:
                        continue
                    start = bad * bs
                    if start < req.num_computed_tokens:
                        kv.uncache_blocks(req, start)
                        req.num_computed_tokens = start
                        recomputing.add(req.request_id)
                        self.stats.load_failures += 1
        return recomputing

    def _drop_loaded(self, req: Request, scheduled: list[ScheduledRequest]) -> bool:
        """Loaded requests waiting behind ``req`` hold blocks; while nothing runs nothing else
        would ever free one, so ``req`` could wait forever.  Then the newest of them loses its
        blocks (their KV stays in the prefix cache: it is re-admitted like a preempted request)
        and this returns True (retry ``req``); otherwise False."""
        if self.running or scheduled:
            return False  # running requests will finish or be preempted
        for victim in reversed(self.waiting):
            if victim is not req and victim.num_computed_tokens:
                self.kv.free(victim)
                victim.num_computed_tokens = 0
                victim.num_preemptions += 1
                self.stats.num_preemptions += 1
                return True
        return False
