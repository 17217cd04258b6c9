"""S3-FIFO (``s3fifo``): a small probationary FIFO, a main FIFO and a ghost table.

After Yang et al., "FIFO queues are all you need for cache eviction" (SOSP '23), adapted to a
pool whose blocks leave the cache while in use.  A freed cached block that was never queued joins
*small*, or *main* when its hash is in the ghost table (its prefix came back after eviction).  A
prefix hit raises the block's frequency (capped at 3).  Victims: while small holds more than
``small_share`` of the pool (or main is empty), small's head moves to main if it was hit, else it
is the victim; otherwise main's head is reinserted at main's tail with its frequency lowered by
one if it was hit, else it is the victim.  Every hit buys at most one reinsertion, so picking is
O(1) amortized.  A block resurrected by a hit returns to the tail of the segment it left.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from kvcore.blocks import KVCacheBlock
from kvcore.eviction.segmented import SegmentedPolicy, check_share

SMALL = 1
MAIN = 2
MAX_FREQ = 3


class S3FIFOPolicy(SegmentedPolicy):
    """``s3fifo``: small + main FIFOs with lazy promotion, ghost table of evicted hashes.

    Args:
        blocks: the pool's usable blocks, in initial reuse order.
        small_share: the fraction of the pool the small FIFO may hold before it yields victims.
        ghost_factor: ghost-table size in multiples of the pool's capacity.
    """

    __slots__ = ("_freq", "_home", "small_cap")
    name: ClassVar[str] = "s3fifo"
    remembers_evictions: ClassVar[bool] = True

    def __init__(self, blocks: Sequence[KVCacheBlock], *, small_share: object = 0.1,
                 ghost_factor: object = 1.0) -> None:
        super().__init__(blocks, 3, ghost_factor)
        self.small_cap = int(check_share("small_share", small_share) * self.capacity)
        self._freq = [0] * len(self._segment_of)
        self._home = [0] * len(self._segment_of)  # SMALL / MAIN once queued, 0 before

    def _place(self, block: KVCacheBlock) -> int:
        bid = block.block_id
        home = self._home[bid]
        if not home:
            h = block.block_hash
            home = MAIN if h is not None and self.ghost.take(h) else SMALL
            self._home[bid] = home
        return home

    def _on_access(self, block: KVCacheBlock) -> None:
        bid = block.block_id
        if self._freq[bid] < MAX_FREQ:
            self._freq[bid] += 1

    def _victim(self) -> KVCacheBlock:
        small = self._segments[SMALL]
        main = self._segments[MAIN]
        freq = self._freq
        while True:
            if len(small) and (len(small) > self.small_cap or not len(main)):
                block = small.first()
                assert block is not None
                if freq[block.block_id]:
                    freq[block.block_id] = 0
                    self._home[block.block_id] = MAIN
                    self._move(block, MAIN)
                    continue
                return self._pop(SMALL)
            block = main.first()
            assert block is not None
            if freq[block.block_id]:
                freq[block.block_id] -= 1
                self._move(block, MAIN)
                continue
            return self._pop(MAIN)

    def on_evict(self, block: KVCacheBlock) -> None:
        bid = block.block_id
        self._freq[bid] = 0
        self._home[bid] = 0
        if block.block_hash is not None:
            self.ghost.add(block.block_hash)

    def reset(self) -> None:
        super().reset()
        self._freq = [0] * len(self._freq)
        self._home = [0] * len(self._home)

    def check(self) -> list[str]:
        problems = super().check()
        for index in (SMALL, MAIN):
            for block in self._segments[index]:
                if self._home[block.block_id] != index:
                    problems.append(f"block {block.block_id} is in segment {index} but its home "
                                    f"is {self._home[block.block_id]}")
        if any(not 0 <= f <= MAX_FREQ for f in self._freq):
            problems.append("a frequency is outside [0, 3]")
        return problems
