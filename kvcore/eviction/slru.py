"""Segmented LRU with a ghost table of evicted hashes (``slru``).

Free cached blocks live in two LRU segments.  A block enters *probation* when it is freed for the
first time after being cached; a block that was hit while cached (freed, resurrected by a prefix
hit, or shared by a running request) enters *protected* when it is freed again.  Victims come
from probation first, so a scan of one-time prefixes cannot flush the blocks that were reused.
Protected holds at most ``protected_share`` of the pool; its least recent blocks are demoted to
probation and must be hit again to return.

The ghost table remembers the last ``ghost_factor × capacity`` evicted hashes: a block cached
under a remembered hash (its prefix came back after eviction) counts as hit and enters
protected directly on its first free.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from kvcore.blocks import KVCacheBlock
from kvcore.eviction.segmented import CLEAN, SegmentedPolicy, check_share

PROBATION = 1
PROTECTED = 2


class SLRUPolicy(SegmentedPolicy):
    """``slru``: probation + protected LRU segments, promotion on a second touch, ghost table.

    Args:
        blocks: the pool's usable blocks, in initial reuse order.
        protected_share: the largest fraction of the pool the protected segment may hold.
        ghost_factor: ghost-table size in multiples of the pool's capacity.
    """

    __slots__ = ("_hot", "protected_cap")
    name: ClassVar[str] = "slru"
    remembers_evictions: ClassVar[bool] = True

    def __init__(self, blocks: Sequence[KVCacheBlock], *, protected_share: object = 0.5,
                 ghost_factor: object = 1.0) -> None:
        super().__init__(blocks, 3, ghost_factor)
        share = check_share("protected_share", protected_share)
        self.protected_cap = int(share * self.capacity)
        self._hot = [False] * len(self._segment_of)

    def _place(self, block: KVCacheBlock) -> int:
        bid = block.block_id
        h = block.block_hash
        if self._hot[bid] or (h is not None and self.ghost.take(h)):
            self._hot[bid] = True
            protected = self._segments[PROTECTED]
            if len(protected) >= self.protected_cap:
                if not self.protected_cap:
                    return PROBATION
                demoted = protected.first()
                assert demoted is not None
                self._hot[demoted.block_id] = False
                self._move(demoted, PROBATION)
            return PROTECTED
        return PROBATION

    def _on_access(self, block: KVCacheBlock) -> None:
        self._hot[block.block_id] = True

    def _victim(self) -> KVCacheBlock:
        index = PROBATION if len(self._segments[PROBATION]) else PROTECTED
        return self._pop(index)

    def on_evict(self, block: KVCacheBlock) -> None:
        self._hot[block.block_id] = False
        if block.block_hash is not None:
            self.ghost.add(block.block_hash)

    def reset(self) -> None:
        super().reset()
        self._hot = [False] * len(self._hot)

    def check(self) -> list[str]:
        problems = super().check()
        protected = self._segments[PROTECTED]
        if len(protected) > self.protected_cap:
            problems.append(f"protected segment holds {len(protected)} > {self.protected_cap}")
        for block in protected:
            if not self._hot[block.block_id]:
                problems.append(f"block {block.block_id} is protected but was never hit")
        for block in self._segments[CLEAN]:
            if self._hot[block.block_id]:
                problems.append(f"uncached block {block.block_id} is marked hit")
        return problems
