"""``lru``, the pool's default eviction policy: an intrusive doubly linked free list.

``FreeBlockQueue`` is a doubly linked list threaded *through* the blocks (``prev_free`` /
``next_free``), bracketed by two sentinel blocks so that no operation branches on "empty".
Every operation is O(1) per block and allocates nothing but the list it returns.  As a policy it
is vLLM's free queue (uncached blocks to the head, cached ones to the tail, a hit unlinks, reuse
pops the head), with no extra layer; the other policies build their segments from it.

Queue order is eviction order: the head is reused first.

    head ⇄ b7 ⇄ b2 ⇄ b9 ⇄ tail          popleft → b7;  append(b4) → ... b9 ⇄ b4 ⇄ tail
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import ClassVar, Final

from kvcore.errors import BlockStateError, InvalidArgumentError, NoFreeBlocksError, NullBlockError
from kvcore.eviction.base import EvictionPolicy
from kvcore.types import KVCacheBlock

_SENTINEL_ID: Final = -1


class FreeBlockQueue(EvictionPolicy):
    """Intrusive doubly linked list of free blocks, in eviction order (head first).

    As an :class:`~kvcore.eviction.EvictionPolicy` it is LRU (vLLM's free queue): uncached blocks
    go to the head, cached ones to the tail, a hit unlinks the block and reuse pops the head.

    The constructor links ``blocks`` in the given order.  The length is a cached counter (the hot
    path needs it); ``kvcore.invariants`` checks it against a walk of the list.

    A link inside the queue is never ``None`` (sentinels bracket it), so the hot paths read links
    into locals typed ``KVCacheBlock`` (``# type: ignore[assignment]  # linked``): free in pure
    Python, and the compiled build then accesses those blocks natively instead of as optionals.
    """

    __slots__ = ("_head", "_num_free", "_tail")
    name: ClassVar[str] = "lru"

    def __init__(self, blocks: Sequence[KVCacheBlock] = ()) -> None:
        self._head = KVCacheBlock(_SENTINEL_ID)
        self._tail = KVCacheBlock(_SENTINEL_ID)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self._num_free = 0
        self.append_n(blocks)

    # -- queries --------------------------------------------------------------------------------
    def __len__(self) -> int:
        return self._num_free

    def __iter__(self) -> Iterator[KVCacheBlock]:
        """Blocks in eviction order (head first)."""
        tail = self._tail
        node = self._head.next_free
        while node is not tail and node is not None:
            yield node
            node = node.next_free

    @property
    def head(self) -> KVCacheBlock:
        """The head sentinel (its ``next_free`` is the first free block, or the tail sentinel)."""
        return self._head

    @property
    def tail(self) -> KVCacheBlock:
        """The tail sentinel."""
        return self._tail

    def first(self) -> KVCacheBlock | None:
        """The block ``popleft`` would return, or ``None`` if empty."""
        node = self._head.next_free
        return None if node is self._tail else node

    def queues(self) -> Sequence[FreeBlockQueue]:
        return (self,)

    def check(self) -> list[str]:
        return []  # the queue's links and length are checked by kvcore.invariants

    # -- the lru policy ---------------------------------------------------------------------------
    def on_free(self, uncached: Sequence[KVCacheBlock], cached: Sequence[KVCacheBlock]) -> None:
        # Linked in one pass each (``prepend_n`` / ``append_n``'s splice, inlined): the pool
        # passes blocks whose reference count just reached 0, so unlike those it does not
        # re-check that each block is unlinked and not the null block (``check_invariants``
        # does).  Every request's blocks come back through here when it finishes.
        node: KVCacheBlock
        if uncached:
            head = self._head
            old_first: KVCacheBlock = head.next_free  # type: ignore[assignment]  # linked
            node = head
            for block in uncached:
                block.prev_free = node
                node.next_free = block
                node = block
            node.next_free = old_first
            old_first.prev_free = node
            self._num_free += len(uncached)
        if cached:
            tail = self._tail
            node = tail.prev_free  # type: ignore[assignment]  # linked
            for block in cached:
                block.prev_free = node
                node.next_free = block
                node = block
            node.next_free = tail
            tail.prev_free = node
            self._num_free += len(cached)

    def on_touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        # Unlinking is inlined (``remove``'s logic): a prefix hit resurrects blocks one by one and
        # this is the hot path.  The null block reads ref_cnt 0 and is skipped there.
        resurrected = 0
        for block in blocks:
            ref_cnt = block.ref_cnt
            if ref_cnt == 0:
                if block.is_null:
                    continue
                prev: KVCacheBlock = block.prev_free  # type: ignore[assignment]  # linked: free
                nxt: KVCacheBlock = block.next_free  # type: ignore[assignment]
                prev.next_free = nxt
                nxt.prev_free = prev
                block.prev_free = block.next_free = None
                resurrected += 1
            block.ref_cnt = ref_cnt + 1
        self._num_free -= resurrected

    def pick_victims(self, n: int, ref_cnt: int) -> list[KVCacheBlock]:
        return self._unlink_first(n, ref_cnt)

    # -- removal --------------------------------------------------------------------------------
    def popleft(self) -> KVCacheBlock:
        """Remove and return the head block; raises :class:`NoFreeBlocksError` when empty."""
        head = self._head
        block = head.next_free
        if block is self._tail or block is None:
            raise NoFreeBlocksError("popleft from an empty free queue")
        nxt: KVCacheBlock = block.next_free  # type: ignore[assignment]  # linked
        head.next_free = nxt
        nxt.prev_free = head
        block.prev_free = block.next_free = None
        self._num_free -= 1
        return block

    def unlinked(self, n: int) -> None:
        """Account for ``n`` blocks a policy unlinked itself (inlined ``remove`` on a hit)."""
        self._num_free -= n

    def linked(self, n: int) -> None:
        """Account for ``n`` blocks a policy linked itself."""
        self._num_free += n

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """Remove and return the first ``n`` blocks, in queue order."""
        if n <= 0:
            if n == 0:
                return []
            raise InvalidArgumentError(f"popleft_n: n must be >= 0, got {n}")
        if n > self._num_free:
            raise NoFreeBlocksError(f"popleft_n({n}) with only {self._num_free} free blocks")
        return self._unlink_first(n, None)

    def _unlink_first(self, n: int, ref_cnt: int | None) -> list[KVCacheBlock]:
        head = self._head
        node: KVCacheBlock = head.next_free  # type: ignore[assignment]  # linked
        nxt: KVCacheBlock
        if n == 1:
            nxt = node.next_free  # type: ignore[assignment]  # linked
            head.next_free = nxt
            nxt.prev_free = head
            node.prev_free = node.next_free = None
            if ref_cnt is not None:
                node.ref_cnt = ref_cnt
            self._num_free -= 1
            return [node]
        out: list[KVCacheBlock] = [head] * n
        for i in range(n):
            out[i] = node
            nxt = node.next_free  # type: ignore[assignment]  # linked
            node.prev_free = node.next_free = None
            if ref_cnt is not None:
                node.ref_cnt = ref_cnt
            node = nxt
        head.next_free = node
        node.prev_free = head
        self._num_free -= n
        return out

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink ``block`` from the middle of the queue in O(1).

        Raises :class:`BlockStateError` (and changes nothing) if the block is not linked.
        """
        prev = block.prev_free
        nxt = block.next_free
        if prev is None or nxt is None:
            raise BlockStateError(f"remove: block {block.block_id} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self._num_free -= 1

    # -- insertion ------------------------------------------------------------------------------
    def append(self, block: KVCacheBlock) -> None:
        """Link ``block`` at the tail (evicted last)."""
        if block.prev_free is not None or block.next_free is not None or block.is_null:
            raise _bad_insert(block)
        tail = self._tail
        last: KVCacheBlock = tail.prev_free  # type: ignore[assignment]  # linked
        last.next_free = block
        block.prev_free = last
        block.next_free = tail
        tail.prev_free = block
        self._num_free += 1

    def append_n(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Link ``blocks`` at the tail, keeping their order (``blocks[-1]`` ends up last)."""
        if not blocks:
            return
        if len(blocks) == 1:
            self.append(blocks[0])
            return
        tail = self._tail
        anchor: KVCacheBlock = tail.prev_free  # type: ignore[assignment]  # linked
        first = self._chain(blocks, anchor)
        last = blocks[-1]
        anchor.next_free = first
        last.next_free = tail
        tail.prev_free = last
        self._num_free += len(blocks)

    def prepend_n(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Link ``blocks`` at the head, keeping their order (``blocks[0]`` is popped next)."""
        if not blocks:
            return
        head = self._head
        old_first: KVCacheBlock = head.next_free  # type: ignore[assignment]  # linked
        if len(blocks) == 1:
            block = blocks[0]
            if block.prev_free is not None or block.next_free is not None or block.is_null:
                raise _bad_insert(block)
            block.prev_free = head
            block.next_free = old_first
            head.next_free = block
            old_first.prev_free = block
            self._num_free += 1
            return
        first = self._chain(blocks, head)
        last = blocks[-1]
        head.next_free = first
        last.next_free = old_first
        old_first.prev_free = last
        self._num_free += len(blocks)

    @staticmethod
    def _chain(blocks: Sequence[KVCacheBlock], anchor: KVCacheBlock) -> KVCacheBlock:
        """Link ``blocks`` after ``anchor`` in order.  A bad block (already linked, repeated, or
        null) is found before the queue is left changed: a repeated block still has the
        ``prev_free`` its first occurrence set, and on error the anchor's old link is restored
        and the blocks linked so far are unlinked.  The last block's ``next_free`` (and the
        other side of the splice) is left for the caller."""
        saved = anchor.next_free
        prev = anchor
        for block in blocks:
            if block.prev_free is not None or block.next_free is not None or block.is_null:
                anchor.next_free = saved
                if prev is not anchor:
                    node: KVCacheBlock | None = blocks[0]
                    while node is not None:
                        nxt = node.next_free
                        node.prev_free = node.next_free = None
                        node = nxt
                raise _bad_insert(block)
            block.prev_free = prev
            prev.next_free = block
            prev = block
        return blocks[0]


def _bad_insert(block: KVCacheBlock) -> BlockStateError:
    if block.is_null:
        return NullBlockError("the null block never enters the free queue")
    return BlockStateError(f"block {block.block_id} is already in a free queue "
                           f"(or repeated in one batch)")


LRUPolicy = FreeBlockQueue
"""The ``lru`` policy's name in the registry."""
