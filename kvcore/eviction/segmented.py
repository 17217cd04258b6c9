"""Shared machinery of the policies that keep free blocks in several intrusive lists.

A :class:`SegmentedPolicy` owns ``k`` :class:`~kvcore.eviction.lru.FreeBlockQueue` segments,
segment 0 holding the uncached blocks (reused first), and a per-block table of the segment each
free block is linked in.  Subclasses override the policy hooks: where freed blocks go
(``on_free``), what a hit does (``on_touch``), and which cached blocks leave next
(``pick_victims`` / ``_victims``), and may remember evicted hashes in a bounded ghost table.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Final

from kvcore.eviction.base import EvictionPolicy
from kvcore.eviction.lru import FreeBlockQueue
from kvcore.types import BlockHash, KVCacheBlock
from kvcore.validation import check_share

GhostKey = BlockHash | tuple[int, BlockHash]
"""A ghost table's key: the evicted block's group and hash, as the hash itself for group 0 (no
tuple on the common path) and ``(group, hash)`` for the others (bytes never equal a tuple).
Each KV-cache group caches its own copy of a prefix, so one group's eviction must not make
another group's copy a ghost return."""


def ghost_key(group_id: int, h: BlockHash) -> GhostKey:
    """The ghost key of ``h`` in group ``group_id`` (see :data:`GhostKey`).

    The per-block paths write this expression out (``h if g == 0 else (g, h)``: slru's
    ``on_free`` and ``pick_victims``, ``_release``, arc's ``on_free`` and ``_forget``): calling
    this function there cost 1.02x on the eviction-heavy slru row and 1.03x on the arc row
    (``kvcore bench manager --scenarios eviction-heavy``, pure Python, 15 repeats, 2026-11-27;
    the unchanged s3fifo row 1.00x)."""
    return h if group_id == 0 else (group_id, h)

# Final: the compiled build inlines them (a plain module constant is a globals lookup per use)
NOT_FREE: Final = -1
CLEAN: Final = 0  # segment of the uncached free blocks


class SegmentedPolicy(EvictionPolicy):
    """Base of ``slru``, ``s3fifo``, ``arc`` and ``learned``: segments, each block's segment and
    access mark (raised by hits up to ``max_mark``, cleared on eviction; both kept on the block,
    ``KVCacheBlock.policy_segment`` / ``policy_mark``), the ghost table and the generic
    transitions.

    The ghost table keeps evicted hashes in two generations (sets): evictions enter the young
    one; once it holds ``ghost_capacity`` hashes it becomes the old one and the previous old
    generation is dropped whole.  So the table remembers at least the last ``ghost_capacity``
    evicted hashes and at most twice as many (plus one batch of victims), at the cost of one
    set insert per eviction and two lookups per freed block, with no pruning pass.

    The hot transitions are inlined rather than built from per-block method calls: a hit unlinks
    its block directly (``FreeBlockQueue.remove``'s logic) and victims leave in batches.
    """

    __slots__ = ("_blocks", "_ghost", "_ghost_old", "_id_space", "_max_mark", "_num_free",
                 "_segments", "capacity", "ghost_capacity")

    def __init__(self, blocks: Sequence[KVCacheBlock], num_segments: int,
                 ghost_factor: object, max_mark: int) -> None:
        factor = check_share("ghost_factor", ghost_factor, 0.0, 64.0)
        self.capacity = len(blocks)
        self._segments = [FreeBlockQueue() for _ in range(num_segments)]
        # Per block, on the block (KVCacheBlock.policy_segment / policy_mark): the segment it
        # is linked in (NOT_FREE when not free) and its access mark.
        self._blocks = list(blocks)
        for block in self._blocks:
            block.policy_segment = NOT_FREE
            block.policy_mark = 0
        self._id_space = max((b.block_id for b in blocks), default=0) + 1
        self._max_mark = max_mark
        self._num_free = 0
        self.ghost_capacity = int(factor * self.capacity)
        self._ghost: set[GhostKey] = set()  # the young generation of evicted (group, hash)
        self._ghost_old: set[GhostKey] = set()
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
        return block.policy_segment

    def in_ghost(self, h: BlockHash, group_id: int = 0) -> bool:
        """Whether ``h`` is a remembered evicted hash (see the class docstring)."""
        key = ghost_key(group_id, h)
        return key in self._ghost or key in self._ghost_old

    def mark(self, block: KVCacheBlock) -> int:
        """``block``'s access mark (hits since it was cached, capped)."""
        return block.policy_mark

    def check(self) -> list[str]:
        problems: list[str] = []
        linked = 0
        for index, segment in enumerate(self._segments):
            for block in segment:
                linked += 1
                if block.policy_segment != index:
                    problems.append(f"block {block.block_id} is linked in segment {index} but "
                                    f"recorded in {block.policy_segment}")
                if (index == CLEAN) != (block.block_hash is None):
                    problems.append(f"block {block.block_id} (hash {block.block_hash!r}) is in "
                                    f"segment {index}: uncached blocks belong to segment 0 only")
        recorded = sum(1 for b in self._blocks if b.policy_segment != NOT_FREE)
        if not linked == recorded == self._num_free:
            problems.append(f"{linked} blocks linked, {recorded} recorded free, count "
                            f"{self._num_free}")
        if any(not 0 <= b.policy_mark <= self._max_mark for b in self._blocks):
            problems.append(f"an access mark is outside [0, {self._max_mark}]")
        if len(self._ghost) >= self.ghost_capacity + self.capacity or len(
                self._ghost_old) >= self.ghost_capacity + self.capacity:
            problems.append(f"a ghost generation holds {len(self._ghost)} / "
                            f"{len(self._ghost_old)} hashes, more than {self.ghost_capacity} "
                            "plus a batch of victims")
        return problems

    # -- transitions ------------------------------------------------------------------------------
    def on_free(self, uncached: Sequence[KVCacheBlock], cached: Sequence[KVCacheBlock]) -> None:
        """Uncached blocks go to the head of the clean segment; subclasses extend this for the
        cached ones (``super().on_free(uncached, ())`` first)."""
        if uncached:
            for block in uncached:
                block.policy_segment = CLEAN
            self._segments[CLEAN].prepend_n(uncached)
            self._num_free += len(uncached)

    def on_touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        segments = self._segments
        top = self._max_mark
        resurrected = 0
        for block in blocks:
            ref_cnt = block.ref_cnt
            if ref_cnt == 0:
                if block.is_null:
                    continue
                segments[block.policy_segment].unlinked(1)
                # FreeBlockQueue.remove, inlined: the call cost 4-7% per resurrected block
                # (BlockPool.touch of free cached blocks, slru / s3fifo / arc, 2026-11-27)
                prev: KVCacheBlock = block.prev_free  # type: ignore[assignment]  # linked: free
                nxt: KVCacheBlock = block.next_free  # type: ignore[assignment]
                prev.next_free = nxt
                nxt.prev_free = prev
                block.prev_free = block.next_free = None
                block.policy_segment = NOT_FREE
                resurrected += 1
            if block.policy_mark < top:
                block.policy_mark += 1
            block.ref_cnt = ref_cnt + 1
        self._num_free -= resurrected

    def on_hit(self, blocks: Sequence[KVCacheBlock]) -> None:
        top = self._max_mark
        for block in blocks:
            if block.policy_mark < top:
                block.policy_mark += 1

    def pick_victims(self, n: int, ref_cnt: int) -> list[KVCacheBlock]:
        clean = self._segments[CLEAN]
        k = min(n, len(clean))
        out = clean.pick_victims(k, ref_cnt) if k else []
        if k < n:
            out.extend(self._victims(n - k, ref_cnt))
        self._release(out)
        self._num_free -= n
        return out

    def remove(self, block: KVCacheBlock) -> None:
        self._segments[block.policy_segment].remove(block)
        block.policy_segment = NOT_FREE
        self._num_free -= 1

    def on_evict(self, blocks: Sequence[KVCacheBlock]) -> None:
        self._release(blocks, linked=False)

    def _release(self, blocks: Sequence[KVCacheBlock], linked: bool = True) -> None:
        """Victims leave the policy (``linked``: they were free, now unlinked) and every hashed
        one is about to be evicted: clear its mark and remember its hash in the ghost table."""
        ghost = self._ghost
        remember = self.ghost_capacity > 0
        for block in blocks:
            if linked:
                block.policy_segment = NOT_FREE
            h = block.block_hash
            if h is not None:
                block.policy_mark = 0
                if remember:
                    g = block.group_id
                    ghost.add(h if g == 0 else (g, h))  # ghost_key(), inlined: see there
        if remember and len(ghost) >= self.ghost_capacity:
            self._age_ghost()

    def _age_ghost(self) -> None:
        """The young ghost generation is full: it becomes the old one, the old one is dropped."""
        self._ghost_old = self._ghost
        self._ghost = set()

    def on_uncache(self, block: KVCacheBlock) -> None:
        if block.policy_segment not in (NOT_FREE, CLEAN):
            self.remove(block)
            self._link(CLEAN, (block,))

    def reset(self) -> None:
        moved = [b for index, s in enumerate(self._segments) if index != CLEAN for b in s]
        for block in moved:
            self.remove(block)
        self._link(CLEAN, moved)
        self._ghost = set()
        self._ghost_old = set()
        for block in self._blocks:
            block.policy_mark = 0

    # -- for subclasses ---------------------------------------------------------------------------
    def _link(self, index: int, blocks: Sequence[KVCacheBlock]) -> None:
        """Append ``blocks`` (not in the policy) to segment ``index``."""
        for block in blocks:
            block.policy_segment = index
        self._segments[index].append_n(blocks)
        self._num_free += len(blocks)

    def _move(self, block: KVCacheBlock, index: int) -> None:
        """Move a free ``block`` to the tail of segment ``index``."""
        self._segments[block.policy_segment].remove(block)
        block.policy_segment = index
        self._segments[index].append(block)

    def _recall(self, key: GhostKey) -> bool:
        """Whether ``key`` is a remembered eviction (and forget it)."""
        if key in self._ghost:
            self._ghost.discard(key)
            self._ghost_old.discard(key)
            return True
        if key in self._ghost_old:
            self._ghost_old.discard(key)
            return True
        return False

    def _victims(self, n: int, ref_cnt: int) -> list[KVCacheBlock]:
        """Unlink and return ``n`` cached victims with ``ref_cnt`` set (the clean segment is
        empty and at least ``n`` cached blocks are free); the caller updates the table."""
        raise NotImplementedError
