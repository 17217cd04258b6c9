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
from typing import ClassVar, Final

from kvcore.eviction.segmented import CLEAN, NOT_FREE, SegmentedPolicy
from kvcore.types import KVCacheBlock
from kvcore.validation import check_share

PROBATION: Final = 1
PROTECTED: Final = 2


class SLRUPolicy(SegmentedPolicy):
    """``slru``: probation + protected LRU segments, promotion on a second touch, ghost table.

    Args:
        blocks: the pool's usable blocks, in initial reuse order.
        protected_share: the largest fraction of the pool the protected segment may hold.
        ghost_factor: ghost-table generation size in multiples of the pool's capacity (the
            table remembers between one and two generations of evicted hashes).
    """

    __slots__ = ("protected_cap",)
    name: ClassVar[str] = "slru"

    def __init__(self, blocks: Sequence[KVCacheBlock], *, protected_share: object = 0.5,
                 ghost_factor: object = 1.0) -> None:
        share = check_share("protected_share", protected_share)  # before any block is linked
        super().__init__(blocks, 3, ghost_factor, max_mark=1)
        self.protected_cap = int(share * self.capacity)

    def on_free(self, uncached: Sequence[KVCacheBlock], cached: Sequence[KVCacheBlock]) -> None:
        if uncached:
            super().on_free(uncached, ())
        if not cached:
            return
        ghost = self._ghost
        old = self._ghost_old
        segments = self._segments
        # Probation blocks are linked in this pass (``FreeBlockQueue.append_n``'s logic, inlined).
        # Unlike ``append_n`` it does not re-check that each block is unlinked and not the null
        # block: the pool passes only blocks whose reference count just reached 0.  Building the
        # list for ``append_n`` instead (a second pass), with ``FreeBlockQueue.pick_victims`` in
        # ``pick_victims`` below, cost 1.04x on the eviction-heavy slru row (``kvcore bench
        # manager``, pure Python, 15 repeats, 2026-11-27).
        probation_q = segments[PROBATION]
        tail = probation_q.tail
        last: KVCacheBlock = tail.prev_free  # type: ignore[assignment]  # linked
        linked = 0
        protected: list[KVCacheBlock] = []
        for block in cached:
            g = block.group_id
            key = block.block_hash if g == 0 else (g, block.block_hash)  # ghost_key(), inlined
            if block.policy_mark or key in ghost or key in old:
                if not block.policy_mark:
                    self._recall(key)  # type: ignore[arg-type]  # cached: hashed
                block.policy_mark = 1
                block.policy_segment = PROTECTED
                protected.append(block)
            else:
                block.policy_segment = PROBATION
                block.prev_free = last
                last.next_free = block
                last = block
                linked += 1
        last.next_free = tail
        tail.prev_free = last
        probation_q.linked(linked)
        if protected:
            top = segments[PROTECTED]
            top.append_n(protected)
            over = len(top) - self.protected_cap
            if over > 0:  # demote the least recent: they must be hit again to return
                demoted = top.popleft_n(over)
                for block in demoted:
                    block.policy_mark = 0
                    block.policy_segment = PROBATION
                segments[PROBATION].append_n(demoted)
        self._num_free += len(cached)

    def pick_victims(self, n: int, ref_cnt: int) -> list[KVCacheBlock]:
        # Clean, then probation, then protected heads.  Unlinking (``FreeBlockQueue``'s) and the
        # release (``_release``: block segments, ghost table) are fused into one pass per
        # segment (the split cost: see ``on_free``); only protected victims carry a mark to clear.
        segments = self._segments
        remember = self.ghost_capacity > 0
        ghost = self._ghost
        out: list[KVCacheBlock] = []
        need = n
        for index in (CLEAN, PROBATION, PROTECTED):
            segment = segments[index]
            k = len(segment)
            if not k:
                continue
            take = need if k >= need else k
            head = segment.head
            node: KVCacheBlock = head.next_free  # type: ignore[assignment]  # linked
            for _ in range(take):
                nxt: KVCacheBlock = node.next_free  # type: ignore[assignment]  # linked
                node.prev_free = node.next_free = None
                node.ref_cnt = ref_cnt
                node.policy_segment = NOT_FREE
                h = node.block_hash
                if h is not None and remember:
                    g = node.group_id
                    ghost.add(h if g == 0 else (g, h))  # ghost_key(), inlined
                out.append(node)
                node = nxt
            head.next_free = node
            node.prev_free = head
            segment.unlinked(take)
            if index == PROTECTED:
                for block in out[-take:]:
                    block.policy_mark = 0
            need -= take
            if not need:
                break
        if remember and len(ghost) >= self.ghost_capacity:
            self._age_ghost()
        self._num_free -= n
        return out

    def check(self) -> list[str]:
        problems = super().check()
        protected = self._segments[PROTECTED]
        if len(protected) > self.protected_cap:
            problems.append(f"protected segment holds {len(protected)} > {self.protected_cap}")
        for block in protected:
            if not block.policy_mark:
                problems.append(f"block {block.block_id} is protected but was never hit")
        for block in self._segments[CLEAN]:
            if block.policy_mark:
                problems.append(f"uncached block {block.block_id} is marked hit")
        return problems
