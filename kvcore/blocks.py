"""The block types: ``KVCacheBlock`` (the per-block record the pool hands out), the
``NullBlock`` placeholder, ``PrefixNode`` (a cached block's exact prefix) and ``BlockHash``.

A block's ``prev_free`` / ``next_free`` links belong to the intrusive free lists of
:mod:`kvcore.eviction.lru`.
"""

from __future__ import annotations

from typing import Any, NewType

from kvcore.errors import NullBlockError

BlockHash = NewType("BlockHash", bytes)
"""A chained block hash (see ``kvcore.hashing``)."""


class PrefixNode:
    """Provenance of a cached block (``verify_hits``, see :mod:`kvcore.verify`): the prefix
    ending with block ``index`` (``tokens``: that block's token ids, ``extra``:
    its extra keys), after the prefix ``parent`` (``None`` for the first block)."""

    __slots__ = ("extra", "index", "parent", "tokens")

    def __init__(self, parent: PrefixNode | None, index: int, tokens: list[int],
                 extra: tuple[tuple[Any, ...], ...] | None) -> None:
        self.parent = parent
        self.index = index
        self.tokens = tokens
        self.extra = extra

    def __repr__(self) -> str:
        return f"PrefixNode(index={self.index}, tokens={self.tokens[:4]}...)"


class KVCacheBlock:
    """Metadata of one KV-cache block.

    ``block_hash`` is set while the block is registered in its group's prefix-cache map, and
    ``group_id`` names that group.  ``prefix_node`` is the exact prefix its KV belongs to when the
    pool verifies hits (:mod:`kvcore.verify`).  ``prev_free`` / ``next_free`` are owned by
    :class:`~kvcore.eviction.lru.FreeBlockQueue`; both are ``None`` exactly when the block is not in a queue.
    """

    __slots__ = ("block_hash", "block_id", "group_id", "is_null", "next_free", "prefix_node",
                 "prev_free", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.group_id = -1
        self.prefix_node: PrefixNode | None = None
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None
        self.is_null = False

    @property
    def _block_hash(self) -> bytes | None:
        """vLLM's private name for the key a block is cached under (its hash followed by its
        group id, 4 bytes big-endian), which vLLM's own tests and connectors read; ``None``
        while the block is not cached."""
        h = self.block_hash
        return None if h is None else h + self.group_id.to_bytes(4, "big")

    def __repr__(self) -> str:
        prev_id = self.prev_free.block_id if self.prev_free is not None else None
        next_id = self.next_free.block_id if self.next_free is not None else None
        h = self.block_hash.hex()[:12] if self.block_hash is not None else None
        return (f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, hash={h}, "
                f"group={self.group_id}, prev={prev_id}, next={next_id})")


class NullBlock(KVCacheBlock):
    """The placeholder block (id 0) that block tables hold where a position has no KV.

    It is never queued, never hashed, and its reference count is not tracked: it reads as 0 and any
    attempt to change it raises :class:`NullBlockError`.
    """

    __slots__ = ()

    def __init__(self, block_id: int = 0) -> None:
        super().__init__(block_id)
        self.is_null = True

    @property
    def ref_cnt(self) -> int:
        return 0

    @ref_cnt.setter
    def ref_cnt(self, value: int) -> None:
        if value != 0:  # the base initialiser writes 0; anything else is a bug in the caller
            raise NullBlockError(
                f"the null block's reference count is not tracked (tried to set {value})")
