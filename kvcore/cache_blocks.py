"""KVCacheBlocks: what the manager hands a scheduler, one block list per KV-cache group."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kvcore._mypyc import mypyc_attr
from kvcore.blocks import KVCacheBlock
from kvcore.errors import InvalidArgumentError

if TYPE_CHECKING:
    from kvcore.kv_request import KVRequest


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
    ``num_resets`` then.  Only an eviction or a reset changes what a cached block holds, so the
    manager need not check again a hit handed back for its request with nothing evicted since,
    and a hit whose blocks were evicted since went stale after the lookup (see
    :func:`kvcore.manager_checks.evictions_since_lookup`)."""

    # No __slots__: a tuple subclass can keep other data only in an instance dict.
    lookup: tuple[KVRequest, int, int, int]
