"""Adaptive Replacement Cache (``arc``).

After Megiddo and Modha, "ARC: A Self-Tuning, Low Overhead Replacement Cache" (FAST '03), adapted
to a pool whose blocks leave the free side while in use.  Every cached block belongs to *T1*
(cached once, never hit since) or *T2* (hit at least once, or cached again soon after its hash
was evicted); the free ones of each are kept in LRU order in their own segment.  Two ghost lists
remember evicted hashes: *B1* those evicted from T1, *B2* those from T2.  A hash cached again
while remembered in B1 says T1 was too small, so the target size ``p`` of T1 grows (by
``max(|B2| / |B1|, 1)``); one remembered in B2 shrinks it; either way the block enters T2.
Victims come from T1's free blocks while T1 (free and in use) holds more than ``p`` blocks, else
from T2's.

Where ARC reacts on a miss, the pool learns a block's hash when it is first freed, so ghost hits
and the T1 -> T2 move happen in ``on_free``; ``p`` steers victim choice only.  The ghost lists
are bounded as in ARC: ``|T1| + |B1| <= c`` and ``|T1| + |T2| + |B1| + |B2| <= 2c`` for a pool
of ``c`` blocks, each entry dropped at most once (O(1) amortized).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from typing import ClassVar, Final

from kvcore.eviction.segmented import CLEAN, GhostKey, SegmentedPolicy
from kvcore.types import KVCacheBlock

T1: Final = 1
T2: Final = 2


class GhostList:
    """An LRU list of evictions, keyed by (group, hash): insert at the young end, drop from the old end, remove any
    one in O(1).  A dict maps each member to its insertion stamp and a deque keeps the stamps in
    order; a removed member leaves a stale deque entry, skipped when the old end is dropped and
    compacted away once stale entries outnumber live ones (O(1) amortized).  ARC's hot paths
    read the member table directly and update in batches."""

    __slots__ = ("_members", "_order", "_stamp")

    def __init__(self) -> None:
        self._members: dict[GhostKey, int] = {}
        self._order: deque[tuple[int, GhostKey]] = deque()
        self._stamp = 0

    def __len__(self) -> int:
        return len(self._members)

    def extend(self, hashes: Sequence[GhostKey]) -> None:
        """Insert ``hashes`` at the young end, in order (moving any present there)."""
        members = self._members
        order = self._order
        stamp = self._stamp
        for h in hashes:
            stamp += 1
            members[h] = stamp
            order.append((stamp, h))
        self._stamp = stamp
        if len(order) > 2 * len(members) + 64:
            self._order = deque((n, g) for n, g in order if members.get(g) == n)

    def discard_all(self, hashes: Sequence[GhostKey]) -> None:
        """Remove every one of ``hashes`` that is a member."""
        members = self._members
        if members:
            for h in hashes:
                members.pop(h, None)

    def drop_oldest(self, n: int) -> None:
        """Remove the ``n`` oldest members (``n <= len(self)``)."""
        members = self._members
        order = self._order
        while n:
            stamp, h = order.popleft()
            if members.get(h) == stamp:
                del members[h]
                n -= 1

    def clear(self) -> None:
        self._members.clear()
        self._order.clear()

    def hashes(self) -> set[GhostKey]:
        return set(self._members)


class ARCPolicy(SegmentedPolicy):
    """``arc``: recency (T1) and frequency (T2) LRU segments balanced by ghost hits.

    Args:
        blocks: the pool's usable blocks, in initial reuse order.
    """

    __slots__ = ("_b1", "_b2", "_home", "_sizes", "target")
    name: ClassVar[str] = "arc"

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        super().__init__(blocks, 3, 0.0, max_mark=1)
        self._home = [0] * self._id_space  # T1 / T2 while cached and homed, else 0
        self._sizes = [0, 0, 0]  # homed blocks (free or in use) in T1, T2 (index 0 unused)
        self._b1 = GhostList()
        self._b2 = GhostList()
        self.target = 0.0  # ARC's p: the size T1 should have

    @property
    def ghosts(self) -> tuple[int, int]:
        """Sizes of the ghost lists B1 and B2."""
        return len(self._b1), len(self._b2)

    @property
    def sizes(self) -> tuple[int, int]:
        """Blocks (free or in use) in T1 and in T2."""
        return self._sizes[T1], self._sizes[T2]

    def home(self, block: KVCacheBlock) -> int:
        """``T1`` (1) or ``T2`` (2) while ``block`` is cached and was freed since, else 0."""
        return self._home[block.block_id]

    # -- transitions ------------------------------------------------------------------------------
    def on_free(self, uncached: Sequence[KVCacheBlock], cached: Sequence[KVCacheBlock]) -> None:
        if uncached:
            homes = self._home
            for block in uncached:
                if homes[block.block_id]:  # lost its hash without on_evict: no longer homed
                    self._sizes[homes[block.block_id]] -= 1
                    homes[block.block_id] = 0
            super().on_free(uncached, ())
        if not cached:
            return
        homes = self._home
        sizes = self._sizes
        b1 = self._b1._members  # the ghost lists' member tables, read directly on this path
        b2 = self._b2._members
        recent: list[KVCacheBlock] = []
        frequent: list[KVCacheBlock] = []
        for block in cached:
            bid = block.block_id
            home = homes[bid]
            if home:
                to = T2 if home == T2 or block.policy_mark else T1
            else:  # first free since it was cached: did its hash come back from a ghost list?
                g = block.group_id
                # ghost_key(), inlined (see there)
                h: GhostKey = block.block_hash if g == 0 else (g, block.block_hash)  # type: ignore[assignment]  # cached: hashed
                to = T2 if block.policy_mark else T1  # hit while in use: a second access
                if b1 and h in b1:
                    self.target = min(self.target + max(len(b2) / len(b1), 1.0), self.capacity)
                    del b1[h]
                    to = T2
                elif b2 and h in b2:
                    self.target = max(self.target - max(len(b1) / len(b2), 1.0), 0.0)
                    del b2[h]
                    to = T2
            if home != to:
                if home:
                    sizes[home] -= 1
                sizes[to] += 1
                homes[bid] = to
            block.policy_mark = 0
            (frequent if to == T2 else recent).append(block)
        if recent:
            self._link(T1, recent)
        if frequent:
            self._link(T2, frequent)
        self._trim()

    def _victims(self, n: int, ref_cnt: int) -> list[KVCacheBlock]:
        t1 = self._segments[T1]
        t2 = self._segments[T2]
        # Take from T1 while it holds more than the target, then from T2, then T1 again.
        over = self._sizes[T1] - self.target
        k1 = min(n, len(t1), max(math.ceil(over), 0))
        k2 = min(n - k1, len(t2))
        k1 += n - k1 - k2
        out = t1.pick_victims(k1, ref_cnt) if k1 else []
        if k2:
            out += t2.pick_victims(k2, ref_cnt)
        return out

    def pick_victims(self, n: int, ref_cnt: int) -> list[KVCacheBlock]:
        out = super().pick_victims(n, ref_cnt)
        self._forget(out)
        return out

    def on_evict(self, blocks: Sequence[KVCacheBlock]) -> None:
        super().on_evict(blocks)
        self._forget(blocks)

    def _forget(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Hashed ``blocks`` are being evicted: they leave T1/T2 and their hashes enter the
        ghost list of the list they leave (a block never freed since caching counts as T1)."""
        homes = self._home
        sizes = self._sizes
        recent: list[GhostKey] = []
        frequent: list[GhostKey] = []
        for block in blocks:
            h = block.block_hash
            if h is None:
                continue
            home = homes[block.block_id]
            if home:
                sizes[home] -= 1
                homes[block.block_id] = 0
            g = block.group_id
            # ghost_key(), inlined (see there)
            (frequent if home == T2 else recent).append(h if g == 0 else (g, h))
        if recent:
            self._b2.discard_all(recent)
            self._b1.extend(recent)
        if frequent:
            self._b1.discard_all(frequent)
            self._b2.extend(frequent)
        self._trim()

    def _trim(self) -> None:
        """Drop the oldest ghost entries beyond ARC's bounds."""
        c = self.capacity
        t1, t2 = self._sizes[T1], self._sizes[T2]
        b1 = self._b1
        n1 = len(b1._members)
        if n1 and t1 + n1 > c:
            b1.drop_oldest(min(n1, t1 + n1 - c))
            n1 = len(b1._members)
        b2 = self._b2
        n2 = len(b2._members)
        if n2 and t1 + t2 + n1 + n2 > 2 * c:
            b2.drop_oldest(min(n2, t1 + t2 + n1 + n2 - 2 * c))

    def reset(self) -> None:
        super().reset()
        self._home = [0] * len(self._home)
        self._sizes = [0, 0, 0]
        self._b1.clear()
        self._b2.clear()
        self.target = 0.0

    def check(self) -> list[str]:
        problems = super().check()
        counted = [0, 0, 0]
        for block in self._blocks:
            home = self._home[block.block_id]
            counted[home] += 1
            if home and block.policy_segment not in (-1, home):
                problems.append(f"block {block.block_id} is homed in T{home} but linked in "
                                f"segment {block.policy_segment}")
        for index in (T1, T2):
            if counted[index] != self._sizes[index]:
                problems.append(f"T{index} counts {self._sizes[index]} blocks, {counted[index]} "
                                "are homed there")
            for block in self._segments[index]:
                if self._home[block.block_id] != index:
                    problems.append(f"block {block.block_id} is in segment {index} but its home "
                                    f"is {self._home[block.block_id]}")
        for block in self._segments[CLEAN]:
            if self._home[block.block_id]:
                problems.append(f"uncached block {block.block_id} is homed in "
                                f"T{self._home[block.block_id]}")
        c = self.capacity
        t1, t2 = self._sizes[T1], self._sizes[T2]
        if t1 + len(self._b1) > c or t1 + t2 + len(self._b1) + len(self._b2) > 2 * c:
            problems.append(f"ghost lists exceed ARC's bounds: T1 {t1}, T2 {t2}, B1 "
                            f"{len(self._b1)}, B2 {len(self._b2)}, capacity {c}")
        if not 0.0 <= self.target <= c:
            problems.append(f"target {self.target} outside [0, {c}]")
        if self._b1.hashes() & self._b2.hashes():
            problems.append("a hash is in both ghost lists")
        return problems
