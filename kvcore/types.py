"""The data types every layer shares: the block record the pool hands out
(:class:`KVCacheBlock`, the :class:`NullBlock` placeholder, the :class:`PrefixNode` provenance of
a cached block, :data:`BlockHash`), the per-group block lists the manager hands a scheduler
(:class:`KVCacheBlocks`, :class:`LookupHit`, and the internal :data:`GroupBlocks` alias), and what
the manager reads from a request (the :class:`KVRequest` protocol and its
:class:`MultiModalItem`).

A block's ``prev_free`` / ``next_free`` links belong to the intrusive free lists of
:mod:`kvcore.eviction.lru`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NewType, Protocol

from kvcore._mypyc import mypyc_attr
from kvcore.errors import InvalidArgumentError, NullBlockError

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
    ``free_stamp``, ``policy_segment``, ``policy_mark``, ``policy_tag`` and ``policy_tail`` are
    the eviction policy's per-block state (:mod:`kvcore.eviction`: the segment a free block is
    linked in, -1 otherwise; its access mark; ``learned``'s category tag, the clock at which it
    was freed and its "tail of a finished request" mark).  They live on the block rather than
    in lists by block id: native int fields, which the compiled build reads and writes without
    boxing an int, and the interpreter without an index.  One pool, one policy: a policy sets
    them for its blocks when it is built.
    """

    __slots__ = ("block_hash", "block_id", "free_stamp", "group_id", "is_null", "next_free",
                 "policy_mark", "policy_segment", "policy_tag", "policy_tail", "prefix_node",
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
        self.free_stamp = 0
        self.policy_segment = -1
        self.policy_mark = 0
        self.policy_tag = -1
        self.policy_tail = 0

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


# The per-group block lists, one shape under three names by who holds them:
GroupBlocks = tuple[list[KVCacheBlock], ...]
"""Per KV-cache group, its block list (``blocks[g]``): what the coordinator builds and returns;
:class:`KVCacheBlocks` is the same shape handed to a scheduler (immutable, vLLM's methods)."""

HitBlocks = list[list[KVCacheBlock]]
"""A hit under construction: one block list per group of a lookup query (the groups that share
a spec), which the single-type managers build and the coordinator turns into ``GroupBlocks``."""


@mypyc_attr(native_class=False)  # a tuple subclass (compiled build: a regular Python class)
class KVCacheBlocks(tuple):
    """One block list per KV-cache group (``blocks[g][i]``: group ``g``'s ``i``-th block)."""

    __slots__ = ()

    @property
    def blocks(self) -> tuple[Sequence[KVCacheBlock], ...]:
        """The per-group lists (vLLM's attribute name)."""
        return tuple(self)

    def get_block_ids(self) -> tuple[list[int], ...]:
        return tuple([b.block_id for b in group] for group in self)

    def get_unhashed_block_ids(self) -> list[int]:
        """Ids of one-group blocks not in the prefix cache (nulls excluded)."""
        if len(self) != 1:
            raise InvalidArgumentError("get_unhashed_block_ids needs exactly one group")
        return [b.block_id for b in self[0] if b.block_hash is None and not b.is_null]

    def __add__(self, other: Any) -> KVCacheBlocks:
        """Concatenate group by group."""
        if not isinstance(other, KVCacheBlocks) or len(other) != len(self):
            return NotImplemented
        return KVCacheBlocks([*a, *b] for a, b in zip(self, other))


@mypyc_attr(native_class=False)  # as KVCacheBlocks
class LookupHit(KVCacheBlocks):
    """A prefix hit as ``get_computed_blocks`` returns it, stamped with its lookup: ``lookup`` is
    the request looked up, the hit tokens, and the pool's ``num_evicted_blocks`` and
    ``num_invalidations`` then.  Only an eviction, a reset or entries moved off a block whose
    writer goes on (partial-block hits: ``BlockPool.move_block_hashes``, or replaced by
    ``cache_partial_block``) change what a cached block holds, so the manager need not check
    again a hit handed back for its request with none of these since,
    and a hit whose blocks were evicted since went stale after the lookup (see
    :func:`kvcore.manager.evictions_since_lookup`).  ``shared_prefix_boundary`` is the lookup's
    shared-prefix boundary (read it with :func:`kvcore.manager.lookup_boundary`; an empty hit is
    stamped only for a non-zero one)."""

    # No __slots__: a tuple subclass can keep other data only in an instance dict.
    lookup: tuple[KVRequest, int, int, int]
    # Set on the instance only when non-zero (sparse retention), and kept out of ``lookup``: a
    # fifth item costs every stamped compiled admission ~105 instructions, to box it at the
    # lookup and unbox it where the stamp is checked (BENCHMARKS.md, issue 37's compiled residual).
    shared_prefix_boundary: int = 0


@dataclass(frozen=True, slots=True)
class MultiModalItem:
    """A multimodal input occupying prompt positions ``[offset, offset + length)``; ``identifier``
    is a content hash of the item, so equal images give equal KV."""

    identifier: str
    offset: int
    length: int


# Structural: kvcore's Request and the vLLM adapter's request implement it without naming it as a
# base (see kvcore.request); interpreted implementations are allowed in the compiled build.
@mypyc_attr(allow_interpreted_subclasses=True)
class KVRequest(Protocol):
    """What the KV-cache manager reads from a request."""

    __slots__ = ()

    request_id: str
    all_token_ids: list[int]
    block_hashes: list[BlockHash]
    num_computed_tokens: int
    num_preemptions: int
    skip_reading_prefix_cache: bool
    lora_name: str | None
    cache_salt: str | None
    mm_items: tuple[MultiModalItem, ...]
    session_id: str | None  # sent in BlockStored events, as vLLM does
    lora_id: int | None  # the LoRA adapter's int id, sent in BlockStored events as vLLM does
    # Tokens of steps whose output is not processed yet, counted in num_computed_tokens
    # (vLLM's async scheduling): blocks leave a window only up to num_computed_tokens minus these.
    num_in_flight_tokens: int

    @property
    def num_tokens(self) -> int: ...

    @property
    def num_prompt_tokens(self) -> int: ...
