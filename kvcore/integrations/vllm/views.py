"""vLLM's internal names over kvcore's state, for code written against vLLM's own manager.

vLLM's scheduler, its connectors and its unit tests reach past ``KVCacheManager`` into its
``coordinator``, the coordinator's ``single_type_managers`` and the ``block_pool``.  The adapter
hands them these views instead: each answers the names those callers read (found by grep over
vLLM 0.32's and 0.33's sources and tests) from kvcore's live state — nothing is copied, so a
view never goes stale — and is read-only where vLLM's callers only read.  Names a caller reads
that are missing here mean a caller kvcore was not checked against: an ``AttributeError`` then,
never a silent default.

Blocks are kvcore's :class:`~kvcore.blocks.KVCacheBlock` objects, which carry vLLM's block
names (``block_id``, ``ref_cnt``, ``block_hash``, ``is_null``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from vllm.v1.core.single_type_kv_cache_manager import (
    CrossAttentionManager as VllmCrossAttentionManager,
)

from kvcore.block_pool import BlockPool
from kvcore.blocks import BlockHash, KVCacheBlock
from kvcore.managers.base import SingleTypeKVCacheManager

if TYPE_CHECKING:
    from kvcore.manager import KVCacheManager


class FreeBlockQueueView:
    """vLLM's ``FreeKVCacheBlockQueue`` names over kvcore's free side (the eviction policy, plus
    the hint reserve when hints are declared)."""

    __slots__ = ("_pool",)

    def __init__(self, pool: BlockPool) -> None:
        self._pool = pool

    @property
    def num_free_blocks(self) -> int:
        return self._pool.num_free_blocks

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """Every free block, in the order they would be reused (the reserve's last)."""
        return [*self._pool.free_queue, *self._pool.reserve]

    def __len__(self) -> int:
        return self._pool.num_free_blocks


class CachedBlockMapView(Mapping[BlockHash, KVCacheBlock]):
    """vLLM's ``cached_block_hash_to_block``, read-only: the cached blocks by hash, over all
    groups (kvcore keeps one map per group: a hash cached in two groups maps to the lower
    group's block and is iterated once per group; ``len`` counts cached blocks)."""

    __slots__ = ("_pool",)

    def __init__(self, pool: BlockPool) -> None:
        self._pool = pool

    def __getitem__(self, block_hash: BlockHash) -> KVCacheBlock:
        for g in range(self._pool.num_groups):
            block = self._pool.cached_blocks_map(g).get(block_hash)
            if block is not None:
                return block
        raise KeyError(block_hash)

    def __iter__(self) -> Iterator[BlockHash]:
        for g in range(self._pool.num_groups):
            yield from self._pool.cached_blocks_map(g)

    def __len__(self) -> int:
        return self._pool.num_cached_blocks()

    @property
    def _cache(self) -> Mapping[bytes, KVCacheBlock]:
        """vLLM's private dict, read-only and made on each read: every cached block by vLLM's
        key (hash followed by the group id, 4 bytes big-endian; the block's ``_block_hash``)."""
        pool = self._pool
        return MappingProxyType({
            h + g.to_bytes(4, "big"): block
            for g in range(pool.num_groups) for h, block in pool.cached_blocks_map(g).items()})


class BlockPoolView:
    """vLLM's ``BlockPool`` names over kvcore's pool (see the module docstring).  The one
    mutating name vLLM's scheduler calls, ``free_blocks``, returns blocks a deferred free
    withheld (kvcore's ``KVCacheManager.free_withheld``)."""

    __slots__ = ("_kv", "_pool", "cached_block_hash_to_block", "enable_caching",
                 "free_block_queue", "hash_block_size", "num_hash_lookahead_tokens")

    def __init__(self, kv: KVCacheManager, hash_block_size: int, num_hash_lookahead_tokens: int
                 ) -> None:
        pool = kv.pool
        self._kv = kv
        self._pool = pool
        self.enable_caching = pool.enable_caching
        self.hash_block_size = hash_block_size
        self.num_hash_lookahead_tokens = num_hash_lookahead_tokens
        self.free_block_queue = FreeBlockQueueView(pool)
        self.cached_block_hash_to_block = CachedBlockMapView(pool)

    @property
    def blocks(self) -> Sequence[KVCacheBlock]:
        return self._pool.blocks

    @property
    def null_block(self) -> KVCacheBlock:
        return self._pool.null_block

    @property
    def num_gpu_blocks(self) -> int:
        return self._pool.num_blocks

    def get_num_free_blocks(self) -> int:
        return self._pool.num_free_blocks

    def get_usage(self) -> float:
        return self._pool.usage

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Return blocks ``pop_blocks_for_free`` withheld, first evicted first (vLLM's
        scheduler drains its deferred frees through this once their step has finished)."""
        self._kv.free_withheld(ordered_blocks)

    def get_cached_block(self, block_hash: BlockHash,
                         kv_cache_group_ids: Sequence[int]) -> list[KVCacheBlock] | None:
        """The block cached under ``block_hash`` in each of these groups, or ``None`` if any
        group misses (vLLM's contract)."""
        return self._pool.get_cached_block(block_hash, kv_cache_group_ids)


class GroupView:
    """vLLM's ``SingleTypeKVCacheManager`` names over one of kvcore's single-type managers:
    the group's id, spec and block size, whether its hits drop the EAGLE block, and (read-only)
    its block tables and cached-block watermarks."""

    __slots__ = ("_manager", "block_pool", "block_size", "kv_cache_group_id", "kv_cache_spec",
                 "num_cached_block", "req_to_blocks", "use_eagle")

    retains_longer_hit = False
    records_new_block_ids = False

    def __init__(self, manager: SingleTypeKVCacheManager, spec: Any, block_pool: BlockPoolView
                 ) -> None:
        self._manager = manager
        self.kv_cache_group_id = manager.group_id
        self.kv_cache_spec = spec
        self.block_size: int = spec.block_size
        self.block_pool = block_pool
        self.use_eagle = manager.use_eagle
        self.req_to_blocks: Mapping[str, list[KVCacheBlock]] = MappingProxyType(
            manager.req_to_blocks)
        self.num_cached_block: Mapping[str, int] = MappingProxyType(manager.num_cached_block)

    @property
    def enable_caching(self) -> bool:
        return self._manager.enable_caching

    @property
    def _null_block(self) -> KVCacheBlock:
        return self._manager.null_block


@VllmCrossAttentionManager.register
class CrossAttentionGroupView(GroupView):
    """The view of a cross-attention group (encoder-decoder models).  Registered as a virtual
    subclass of vLLM's ``CrossAttentionManager`` (an ABC), so code that finds the encoder group
    by ``isinstance`` — vLLM's own scheduler tests do — finds it here too."""

    __slots__ = ()


class CoordinatorView:
    """vLLM's ``KVCacheCoordinator`` names over kvcore's coordinator: the pool, one
    :class:`GroupView` per group, the EAGLE group sets, and the block count the scheduler's
    reservation of in-flight prefills reads."""

    enable_partial_hash_hits = False
    num_reprefillable_tokens = 0

    def __init__(self, kv: KVCacheManager, kv_cache_config: Any, block_pool: BlockPoolView,
                 eagle_group_ids: set[int], drop_eagle_group_ids: set[int]) -> None:
        self._kv = kv
        self.kv_cache_config = kv_cache_config
        self.block_pool = block_pool
        self.single_type_managers = tuple(
            (CrossAttentionGroupView if m.uses_encoder_tokens else GroupView)(
                m, g.kv_cache_spec, block_pool)
            for m, g in zip(kv.coordinator.managers, kv_cache_config.kv_cache_groups))
        self.eagle_group_ids = eagle_group_ids
        self.drop_eagle_group_ids = drop_eagle_group_ids

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int,
                                   new_computed_blocks: Sequence[Sequence[KVCacheBlock]],
                                   num_encoder_tokens: int, total_computed_tokens: int,
                                   num_local_computed_tokens: int, num_tokens_main_model: int,
                                   apply_admission_cap: bool = False,
                                   prefill_end: int = 0) -> int:
        """Free blocks the request needs to hold ``num_tokens`` tokens (vLLM's reservation of
        in-flight prefills reads it)."""
        kv = self._kv
        return kv.coordinator.num_blocks_to_allocate(
            request_id, num_tokens, new_computed_blocks, num_encoder_tokens,
            total_computed_tokens, kv.admission_caps if apply_admission_cap else None)
