"""The offline bounds inside vLLM's scheduler, for the vLLM replay only (engines
``kvcore:belady`` and ``kvcore:reuse_oracle``).

vLLM's configuration refuses offline policies (``additional_config["kvcore"]`` names only those
a server can run).  The replay builds them itself: :func:`bound_scheduler_cls` is kvcore's
scheduler class whose adapter's pool runs one of :data:`~kvcore.sim.oracle.REPLAY_ORACLES` in
place of the settings' policy, and :class:`OracleFeed` tells it the future, as kvcore's own
replay does (:func:`kvcore.sim.replay._teach_oracle`).

The key space is the pool's: the adapter hashes nothing itself (``EngineHashes``), the pool
caches a block under the hash of vLLM's request at that position (``request.block_hashes``,
vLLM's hash function and block size), so the bound learns each request's own vLLM hashes: the
prompt's full blocks, the last token excluded, as vLLM caps a lookup.  Arrival index ``i`` (in
arrival order) can hit them; when request ``i`` is first scheduled, the uses before it are past
(:meth:`~kvcore.sim.oracle.ReplayBelady.advance`).  One KV-cache group at the hash block size
only (the bound ranks one pool map).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from kvcore.errors import InvalidArgumentError
from kvcore.sim.oracle import REPLAY_ORACLES, ReplayBelady
from kvcore.types import BlockHash


@functools.cache
def bound_scheduler_cls(base: type, oracle: str) -> type:
    """``base`` (kvcore's ``Scheduler`` or ``AsyncScheduler``) with the adapter's pool running
    the offline bound ``oracle`` (a :data:`REPLAY_ORACLES` name)."""
    from kvcore.integrations.vllm.manager import KVCacheManagerAdapter
    from kvcore.integrations.vllm.settings import KvcoreSettings

    policy = REPLAY_ORACLES[oracle]

    def kvcore_manager_factory(self: Any, settings: KvcoreSettings) -> Callable[..., Any]:
        return functools.partial(KVCacheManagerAdapter, settings=settings, eviction_policy=policy)

    return type(f"{policy.__name__}{base.__name__}", (base,), {
        "kvcore_manager_factory": kvcore_manager_factory, "__module__": __name__,
        "__doc__": f"{base.__qualname__} whose pool runs the offline bound {oracle}."})


class OracleFeed:
    """Tells the offline bound in ``sched``'s pool the future of ``requests`` (vLLM requests,
    made and hashed, in arrival order) and, through :meth:`scheduled`, who was admitted."""

    def __init__(self, sched: Any, requests: Sequence[Any]) -> None:
        kv = sched.kv_cache_manager.kv  # the adapter's kvcore manager
        policy = kv.pool.policy
        if not isinstance(policy, ReplayBelady):
            raise InvalidArgumentError(f"the scheduler's pool runs {policy.name}, not an offline "
                                       "bound (make it with bound_scheduler_cls)")
        managers = kv.coordinator.managers
        if len(managers) != 1 or managers[0].block_size != kv.hash_block_size:
            raise InvalidArgumentError(
                f"the {policy.name} bound replays one KV-cache group at the hash block size only")
        uses: dict[BlockHash, list[int]] = {}
        self.index: dict[str, int] = {}
        for i, req in enumerate(requests):
            self.index[req.request_id] = i
            for h in req.block_hashes[:(req.num_prompt_tokens - 1) // kv.hash_block_size]:
                uses.setdefault(h, []).append(i)
        policy.uses = uses
        self.policy = policy
        self._requests = {req.request_id: req for req in requests}

    def scheduled(self, request_ids: Iterable[str]) -> None:
        """These requests were scheduled for the first time: their uses are past."""
        for rid in request_ids:
            self.policy.advance(self.index[rid], self._requests[rid].block_hashes)
