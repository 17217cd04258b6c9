"""Shared machinery of the policies that keep free blocks in several intrusive lists.

A :class:`SegmentedPolicy` owns ``k`` :class:`~kvcore.blocks.FreeBlockQueue` segments, segment 0
holding the uncached blocks (reused first), and a per-block table of the segment each free
block is linked in.  Subclasses decide where a freed cached block goes (``_place``), what an
access does (``_on_access``) and which cached block is the next victim (``_victim``), and may
remember evicted hashes in a bounded ghost table.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence

from kvcore.blocks import BlockHash, FreeBlockQueue, KVCacheBlock
from kvcore.errors import InvalidArgumentError
from kvcore.policy import EvictionPolicy

NOT_FREE = -1
CLEAN = 0  # segment of the uncached free blocks


def check_share(name: str, value: object, low: float = 0.0, high: float = 1.0) -> float:
    """``value`` as a float in ``[low, high]``, or :class:`InvalidArgumentError` naming it."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise InvalidArgumentError(f"{name} must be a number in [{low}, {high}], got {value!r}")
    return float(value)


class GhostTable:
    """The most recent ``capacity`` evicted hashes, oldest dropped first (O(1) per operation)."""

    __slots__ = ("_hashes", "capacity")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._hashes: OrderedDict[BlockHash, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._hashes)

    def __contains__(self, h: object) -> bool:
        return h in self._hashes

    def add(self, h: BlockHash) -> None:
        hashes = self._hashes
        if h in hashes:
            hashes.move_to_end(h)
            return
        hashes[h] = None
        if len(hashes) > self.capacity:
            hashes.popitem(last=False)

    def take(self, h: BlockHash) -> bool:
        """Whether ``h`` was remembered (and forget it)."""
        return self._hashes.pop(h, 0) is None

    def clear(self) -> None:
        self._hashes.clear()


class SegmentedPolicy(EvictionPolicy):
    """Base of ``slru`` and ``s3fifo``: segments, the segment table and the generic transitions."""

    __slots__ = ("_num_free", "_segment_of", "_segments", "capacity", "ghost")

    def __init__(self, blocks: Sequence[KVCacheBlock], num_segments: int,
                 ghost_factor: object) -> None:
        factor = check_share("ghost_factor", ghost_factor, 0.0, 64.0)
        self.capacity = len(blocks)
        self._segments = [FreeBlockQueue() for _ in range(num_segments)]
        size = max((b.block_id for b in blocks), default=0) + 1
        self._segment_of = [NOT_FREE] * size
        self._num_free = 0
        self.ghost = GhostTable(int(factor * self.capacity))
        self._link(CLEAN, blocks)

    # -- queries ----------------------------------------------------------------------------------
    def __len__(self) -> int:
        return self._num_free

    def __iter__(self) -> Iterator[KVCacheBlock]:
        for segment in self._segments:
            yield from segment

    def first(self) -> KVCacheBlock | None:
        for segment in self._segments:
            block = segment.first()
            if block is not None:
                return block
        return None

    def queues(self) -> Sequence[FreeBlockQueue]:
        return self._segments

    def segment_of(self, block: KVCacheBlock) -> int:
        """The segment ``block`` is linked in, or -1 when it is not free."""
        return self._segment_of[block.block_id]

    def check(self) -> list[str]:
        problems: list[str] = []
        linked = 0
        for index, segment in enumerate(self._segments):
            for block in segment:
                linked += 1
                if self._segment_of[block.block_id] != index:
                    problems.append(f"block {block.block_id} is linked in segment {index} but "
                                    f"recorded in {self._segment_of[block.block_id]}")
                if (index == CLEAN) != (block.block_hash is None):
                    problems.append(f"block {block.block_id} (hash {block.block_hash!r}) is in "
                                    f"segment {index}: uncached blocks belong to segment 0 only")
        recorded = sum(1 for s in self._segment_of if s != NOT_FREE)
        if not linked == recorded == self._num_free:
            problems.append(f"{linked} blocks linked, {recorded} recorded free, count "
                            f"{self._num_free}")
        if len(self.ghost) > self.ghost.capacity:
            problems.append(f"ghost table holds {len(self.ghost)} > {self.ghost.capacity} hashes")
        return problems

    # -- transitions ------------------------------------------------------------------------------
    def on_free(self, uncached: Sequence[KVCacheBlock], cached: Sequence[KVCacheBlock]) -> None:
        if uncached:
            segment_of = self._segment_of
            for block in uncached:
                segment_of[block.block_id] = CLEAN
            self._segments[CLEAN].prepend_n(uncached)
            self._num_free += len(uncached)
        for block in cached:
            self._link(self._place(block), (block,))

    def on_touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        segment_of = self._segment_of
        segments = self._segments
        for block in blocks:
            ref_cnt = block.ref_cnt
            if ref_cnt == 0:
                if block.is_null:
                    continue
                bid = block.block_id
                segments[segment_of[bid]].remove(block)
                segment_of[bid] = NOT_FREE
                self._num_free -= 1
            self._on_access(block)
            block.ref_cnt = ref_cnt + 1

    def pick_victims(self, n: int, ref_cnt: int) -> list[KVCacheBlock]:
        clean = self._segments[CLEAN]
        out = clean.popleft_n(min(n, len(clean)))
        while len(out) < n:
            out.append(self._victim())
        segment_of = self._segment_of
        for block in out:
            segment_of[block.block_id] = NOT_FREE
            block.ref_cnt = ref_cnt
        self._num_free -= n
        return out

    def remove(self, block: KVCacheBlock) -> None:
        bid = block.block_id
        self._segments[self._segment_of[bid]].remove(block)
        self._segment_of[bid] = NOT_FREE
        self._num_free -= 1

    def on_uncache(self, block: KVCacheBlock) -> None:
        if self._segment_of[block.block_id] not in (NOT_FREE, CLEAN):
            self.remove(block)
            self._link(CLEAN, (block,))

    def reset(self) -> None:
        moved = [b for index, s in enumerate(self._segments) if index != CLEAN for b in s]
        for block in moved:
            self.remove(block)
        self._link(CLEAN, moved)
        self.ghost.clear()

    # -- for subclasses ---------------------------------------------------------------------------
    def _link(self, index: int, blocks: Sequence[KVCacheBlock]) -> None:
        """Append ``blocks`` to segment ``index``."""
        segment_of = self._segment_of
        for block in blocks:
            segment_of[block.block_id] = index
        self._segments[index].append_n(blocks)
        self._num_free += len(blocks)

    def _move(self, block: KVCacheBlock, index: int) -> None:
        """Move a free ``block`` to the tail of segment ``index``."""
        bid = block.block_id
        self._segments[self._segment_of[bid]].remove(block)
        self._segment_of[bid] = index
        self._segments[index].append(block)

    def _pop(self, index: int) -> KVCacheBlock:
        """Unlink and return the head of segment ``index`` (not empty)."""
        block = self._segments[index].popleft()
        self._segment_of[block.block_id] = NOT_FREE
        return block

    def _place(self, block: KVCacheBlock) -> int:
        """The segment a freed cached ``block`` joins (at its tail)."""
        raise NotImplementedError

    def _on_access(self, block: KVCacheBlock) -> None:
        """A prefix hit on ``block`` (free or in use)."""
        raise NotImplementedError

    def _victim(self) -> KVCacheBlock:
        """Unlink and return the next cached victim (the clean segment is empty, and some
        cached block is free)."""
        raise NotImplementedError
