"""Simulator-only eviction policies: ``fifo``, ``lfu``, the offline bound ``belady`` and
``reuse_oracle`` (LRU with a perfect prediction of which blocks are ever needed again).

They are registered with ``offline=True`` (:mod:`kvcore.eviction.registry`): the policy
simulator (:mod:`kvcore.sim.policies`) runs them, the real pool refuses them.  They keep their
order in a ``sortedcontainers`` list (O(log n) per block, where the pool's policies are O(1)),
and ``belady`` and ``reuse_oracle`` need the future (the simulator sets each block's next use
before releasing it).
They are not part of the compiled build.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import ClassVar

from sortedcontainers import SortedList

from kvcore.eviction.base import EvictionPolicy
from kvcore.eviction.lru import FreeBlockQueue
from kvcore.types import KVCacheBlock

INFINITE = float("inf")


class PriorityPolicy(EvictionPolicy):
    """An offline policy: cached free blocks ordered by a priority the subclass computes when a
    block is freed (lowest evicted first); uncached blocks are reused first.  O(log n).

    The cached free blocks are also linked, in freeing order, in an intrusive list (``_held``),
    so that ``check_invariants`` sees every free block in some list when the policy runs in a
    real pool (the replay's offline bound).
    """

    __slots__ = ("_clean", "_clock", "_entries", "_held", "_order")

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        self._clean = FreeBlockQueue(blocks)
        self._held = FreeBlockQueue()
        self._order: SortedList = SortedList()
        self._entries: dict[int, tuple[tuple[float, ...], int, KVCacheBlock]] = {}
        self._clock = 0

    def __len__(self) -> int:
        return len(self._clean) + len(self._order)

    def __iter__(self) -> Iterator[KVCacheBlock]:
        yield from self._clean
        for _, _, bid in self._order:
            yield self._entries[bid][2]

    def first(self) -> KVCacheBlock | None:
        block = self._clean.first()
        if block is None and self._order:
            block = self._entries[self._order[0][2]][2]
        return block

    def queues(self) -> Sequence[FreeBlockQueue]:
        return (self._clean, self._held)

    def check(self) -> list[str]:
        if not len(self._order) == len(self._entries) == len(self._held):
            return [f"{len(self._order)} ordered, {len(self._entries)} entries, "
                    f"{len(self._held)} linked cached free blocks"]
        return []

    def on_free(self, uncached: Sequence[KVCacheBlock], cached: Sequence[KVCacheBlock]) -> None:
        self._clean.prepend_n(uncached)
        for block in cached:
            self._clock += 1
            entry = (self._priority(block, self._clock), self._clock, block)
            self._entries[block.block_id] = entry
            self._order.add((entry[0], entry[1], block.block_id))
            self._held.append(block)

    def on_touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        for block in blocks:
            if block.ref_cnt == 0 and not block.is_null:
                self.remove(block)
            block.ref_cnt += 1

    def remove(self, block: KVCacheBlock) -> None:
        entry = self._entries.pop(block.block_id, None)
        if entry is None:
            self._clean.remove(block)
        else:
            self._order.remove((entry[0], entry[1], block.block_id))
            self._held.remove(block)

    def on_uncache(self, block: KVCacheBlock) -> None:
        entry = self._entries.pop(block.block_id, None)
        if entry is not None:  # it lost its hash while free: no cache value left
            self._order.remove((entry[0], entry[1], block.block_id))
            self._held.remove(block)
            self._clean.append(block)

    def reset(self) -> None:
        for block in list(self._held):
            self.on_uncache(block)

    def pick_victims(self, n: int, ref_cnt: int) -> list[KVCacheBlock]:
        out = self._clean.popleft_n(min(n, len(self._clean)))
        while len(out) < n:
            _, _, bid = self._order.pop(0)
            block = self._entries.pop(bid)[2]
            self._held.remove(block)
            out.append(block)
        for block in out:
            block.ref_cnt = ref_cnt
        self.on_evict([b for b in out if b.block_hash is not None])
        return out

    def _priority(self, block: KVCacheBlock, clock: int) -> tuple[float, ...]:
        raise NotImplementedError


class FIFOPolicy(PriorityPolicy):
    """``fifo``: evict in the order blocks were first cached; hits do not refresh."""

    __slots__ = ("_born",)
    name: ClassVar[str] = "fifo"

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        super().__init__(blocks)
        self._born: dict[int, int] = {}

    def _priority(self, block: KVCacheBlock, clock: int) -> tuple[float, ...]:
        return (self._born.setdefault(block.block_id, clock),)

    def on_evict(self, blocks: Sequence[KVCacheBlock]) -> None:
        for block in blocks:
            self._born.pop(block.block_id, None)


class LFUPolicy(PriorityPolicy):
    """``lfu``: evict the block released fewest times since it was cached, then the least
    recent."""

    __slots__ = ("_uses",)
    name: ClassVar[str] = "lfu"

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        super().__init__(blocks)
        self._uses: dict[int, int] = {}

    def _priority(self, block: KVCacheBlock, clock: int) -> tuple[float, ...]:
        uses = self._uses[block.block_id] = self._uses.get(block.block_id, 0) + 1
        return (uses, clock)

    def on_evict(self, blocks: Sequence[KVCacheBlock]) -> None:
        for block in blocks:
            self._uses.pop(block.block_id, None)


class BeladyPolicy(PriorityPolicy):
    """``belady`` (offline bound): evict the block whose key is needed furthest in the future;
    the simulator sets ``next_use`` before each release."""

    __slots__ = ("next_use",)
    name: ClassVar[str] = "belady"

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        super().__init__(blocks)
        self.next_use: dict[int, float] = {}

    def _priority(self, block: KVCacheBlock, clock: int) -> tuple[float, ...]:
        return (-self.next_use.pop(block.block_id, INFINITE), clock)


class ReuseOraclePolicy(BeladyPolicy):
    """``reuse_oracle``: LRU, except that blocks never needed again go first.  It knows *whether*
    a block is reused, not *when*: the hit rate a perfect reuse (admission) predictor reaches in
    recency order, between LRU and Belady."""

    __slots__ = ()
    name: ClassVar[str] = "reuse_oracle"

    def _priority(self, block: KVCacheBlock, clock: int) -> tuple[float, ...]:
        return (float(self.next_use.pop(block.block_id, INFINITE) != INFINITE), clock)
