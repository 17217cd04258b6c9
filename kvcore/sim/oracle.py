"""Offline policies inside the real pool, for the scheduler replay: Belady's bound and the reuse
oracle (:data:`REPLAY_ORACLES`, by name).

:class:`ReplayBelady` is a pool eviction policy that knows the whole trace: a free cached block's
priority is the arrival index of the next request whose prompt holds its hash (furthest first
evicted).  The replay tells it when a request is admitted (``advance``), so blocks whose next use
just passed are re-ranked by the use after it.  It is an offline bound for the replay (the
scheduler's concurrency, chunking and preemption included), not a policy a server could run.
:class:`ReplayReuseOracle` knows only *whether* a free block's hash is needed again: LRU with
the blocks never needed again evicted first (what a perfect reuse predictor reaches).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import ClassVar

from kvcore.eviction.offline import INFINITE, PriorityPolicy
from kvcore.eviction.registry import OFFLINE_BOUND, REUSE_ORACLE
from kvcore.types import BlockHash, KVCacheBlock


class ReplayBelady(PriorityPolicy):
    """Offline Belady over block hashes; ``uses`` maps a hash to the sorted arrival indices of
    the requests that can hit it (set before the replay starts)."""

    __slots__ = ("_free_by_hash", "now", "uses")
    name: ClassVar[str] = "belady"

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        super().__init__(blocks)
        self.uses: dict[BlockHash, list[int]] = {}
        self.now = 0  # requests with a lower arrival index have been admitted
        self._free_by_hash: dict[BlockHash, set[int]] = {}

    def next_use(self, h: BlockHash) -> float:
        indices = self.uses.get(h)
        if not indices:
            return INFINITE
        k = bisect_left(indices, self.now)
        return indices[k] if k < len(indices) else INFINITE

    def _priority(self, block: KVCacheBlock, clock: int) -> tuple[float, ...]:
        h = block.block_hash
        assert h is not None
        self._free_by_hash.setdefault(h, set()).add(block.block_id)
        return (-self.next_use(h), clock)

    def remove(self, block: KVCacheBlock) -> None:
        self._forget(block)
        super().remove(block)

    def on_evict(self, blocks: Sequence[KVCacheBlock]) -> None:
        for block in blocks:  # still hashed: drop it from the hash index
            self._forget(block)

    def reset(self) -> None:
        super().reset()
        self._free_by_hash.clear()

    def _forget(self, block: KVCacheBlock) -> None:
        h = block.block_hash
        ids = self._free_by_hash.get(h) if h is not None else None
        if ids is not None:
            ids.discard(block.block_id)
            if not ids:
                del self._free_by_hash[h]  # type: ignore[arg-type]  # h is set when ids is

    def advance(self, admitted_index: int, hashes: Iterable[BlockHash]) -> None:
        """Request ``admitted_index`` was admitted: its hashes' next uses move on."""
        self.now = max(self.now, admitted_index + 1)
        for h in hashes:
            for bid in list(self._free_by_hash.get(h, ())):
                block = self._entries[bid][2]
                self.remove(block)
                self.on_free((), (block,))


class ReplayReuseOracle(ReplayBelady):
    """The reuse oracle over block hashes: least recently freed first, except that a block whose
    hash no later request needs goes before every other."""

    __slots__ = ()
    name: ClassVar[str] = REUSE_ORACLE

    def _priority(self, block: KVCacheBlock, clock: int) -> tuple[float, ...]:
        (negated_next_use, _) = super()._priority(block, clock)
        return (float(negated_next_use != -INFINITE), clock)


REPLAY_ORACLES: Mapping[str, type[ReplayBelady]] = MappingProxyType(
    {OFFLINE_BOUND: ReplayBelady, REUSE_ORACLE: ReplayReuseOracle})
"""The offline policies the scheduler replay runs, by name: they read the trace and are bounds
for arrival order (the replay refuses them with another schedule policy)."""
