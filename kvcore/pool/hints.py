"""HintReserve: the soft pins of scheduler hints (``BlockPool.set_hints``).

A scheduler declares the prefixes it is about to run; free blocks caching a declared hash wait
in the reserve, a free list of their own (least urgent first), reused only once the eviction
policy has no block left.  The reserve holds at most ``cap`` blocks (past it, its least urgent
block returns to the policy), so hints never leave the policy nothing to choose from.  Hints
change eviction order only, never a hit or whether an allocation succeeds.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from kvcore.eviction.base import EvictionPolicy
from kvcore.eviction.lru import FreeBlockQueue
from kvcore.types import BlockHash, KVCacheBlock

HINT_RESERVE_SHARE: Final = 0.5
"""The largest share of the pool that scheduler hints may hold back from the eviction policy:
deeper hints would leave the policy nothing to choose from."""


class HintReserve:
    """Declared hashes per group (``hints``, ``None`` when nothing is declared) and the free
    blocks held for them (``queue``, their ids in ``held``)."""

    __slots__ = ("cap", "held", "hints", "policy", "queue")

    def __init__(self, num_usable_blocks: int, policy: EvictionPolicy) -> None:
        self.cap = int(HINT_RESERVE_SHARE * num_usable_blocks)
        self.policy = policy
        self.hints: list[dict[BlockHash, None]] | None = None
        self.queue = FreeBlockQueue()
        self.held: set[int] = set()

    def hold(self, block: KVCacheBlock) -> None:
        """Append a free cached block; past the cap, the least urgent returns to the policy."""
        self.queue.append(block)
        self.held.add(block.block_id)
        if len(self.queue) > self.cap:
            released = self.queue.first()
            assert released is not None  # the reserve is over its cap
            self.unhold(released)
            self.policy.on_free((), (released,))

    def unhold(self, block: KVCacheBlock) -> None:
        """Take ``block`` out (the caller decides where it goes)."""
        self.queue.remove(block)
        self.held.discard(block.block_id)

    def release(self, n: int) -> None:
        """Return the ``n`` least urgent blocks to the policy (``n <= len(queue)``)."""
        released = self.queue.popleft_n(n)
        self.held.difference_update(b.block_id for b in released)
        self.policy.on_free((), released)

    def divert(self, blocks: list[KVCacheBlock],
               cached: Sequence[dict[BlockHash, KVCacheBlock]]) -> list[KVCacheBlock]:
        """Hold the freed cached ``blocks`` that serve a declared prefix (the block a lookup
        would hit); return the others."""
        hints = self.hints
        assert hints is not None
        rest: list[KVCacheBlock] = []
        for block in blocks:
            g = block.group_id
            h = block.block_hash
            if h in hints[g] and cached[g].get(h) is block:
                self.hold(block)
            else:
                rest.append(block)
        return rest

    def declare(self, hints: list[dict[BlockHash, None]] | None,
                cached: Sequence[dict[BlockHash, KVCacheBlock]]) -> None:
        """Replace the declaration (``None``: clear it): blocks no longer declared return to the
        policy, free blocks caching a declared hash are held, most urgent last."""
        self.hints = hints
        kept: set[int] = set()
        back: list[KVCacheBlock] = []
        for block in list(self.queue):
            self.unhold(block)
            if hints is not None and block.block_hash in hints[block.group_id]:
                kept.add(block.block_id)
            else:
                back.append(block)
        if back:
            self.policy.on_free((), back)
        if hints is None:
            return
        # Least urgent first into the reserve, so that pressure releases it first.
        for g, declared in enumerate(hints):
            group_map = cached[g]
            for h in reversed(declared):
                found = group_map.get(h)
                if found is not None and found.ref_cnt == 0 and found.block_id not in self.held:
                    if found.block_id in kept:
                        kept.discard(found.block_id)
                    else:
                        self.policy.remove(found)
                    self.hold(found)
