"""Coordinator for one KV-cache group: the group's own hit rule is the answer."""

from __future__ import annotations

from collections.abc import Sequence

from kvcore.blocks import BlockHash, KVCacheBlock
from kvcore.coordinator.base import GroupBlocks, KVCacheCoordinator
from kvcore.errors import InvalidArgumentError
from kvcore.managers import ManagerClasses
from kvcore.managers.base import HitQuery
from kvcore.request import KVRequest
from kvcore.specs import KVCacheConfig
from kvcore.verify import HitVerifier


class UnitaryCoordinator(KVCacheCoordinator):
    def __init__(self, config: KVCacheConfig, *, enable_events: bool = False,
                 verify_hits: bool = False, use_eagle: bool = False,
                 manager_classes: ManagerClasses | None = None) -> None:
        if config.num_groups != 1:
            raise InvalidArgumentError(
                f"UnitaryCoordinator needs exactly one group, got {config.num_groups}")
        super().__init__(config, enable_caching=True, enable_events=enable_events,
                         verify_hits=verify_hits, alignment_tokens=config.groups[0].spec.block_size,
                         use_eagle=use_eagle, manager_classes=manager_classes)
        self._manager = self.managers[0]
        m = self._manager
        # One query reused by every lookup (lookups are not reentrant): building a fresh one
        # would cost more than a short hit itself.
        self._query = HitQuery((), 0, (0,), self.pool, m.spec, m.block_size,
                               drop_last=use_eagle)
        if not self._is_cross[0]:
            # One group: skip the per-group loops of the base class (hot path).
            self.get_num_blocks_to_allocate = self._get_num_blocks_to_allocate  # type: ignore[method-assign]
            self.allocate_new_blocks = self._allocate_new_blocks  # type: ignore[method-assign]
            self.cache_blocks = self._cache_blocks  # type: ignore[method-assign]
            self.remove_skipped_blocks = self._manager.remove_skipped_blocks  # type: ignore[method-assign]
            self.get_num_freeable_skipped_blocks = (  # type: ignore[method-assign]
                self._manager.get_num_freeable_skipped_blocks)
            self.grow = self._grow  # type: ignore[method-assign]
            self.start = self._start  # type: ignore[method-assign]
            if self.prefix_chains is None:  # else the base free also drops the request's chain
                self.free = self._manager.free  # type: ignore[method-assign]

    def _grow(self, request: KVRequest, num_computed_tokens: int, num_slots: int,
              num_tokens_to_cache: int | None) -> GroupBlocks | None:
        m = self._manager
        rid = request.request_id
        blocks = m.req_to_blocks[rid]
        need = -(-num_slots // m.block_size) - len(blocks)
        if need > 0 and need > (self.pool.num_free_blocks
                                + m.get_num_freeable_skipped_blocks(rid, num_computed_tokens)):
            return None
        if m.releases_blocks:
            m.remove_skipped_blocks(rid, num_computed_tokens)
        new = self.pool.get_new_blocks(need) if need > 0 else []
        if new:
            blocks.extend(new)
        if num_tokens_to_cache is not None and (
                num_tokens_to_cache // m.block_size > m.num_cached_block.get(rid, 0)):
            m.cache_blocks(request, num_tokens_to_cache)
        return (new,)

    def _start(self, request: KVRequest, num_slots: int,
               num_tokens_to_cache: int | None) -> GroupBlocks | None:
        m = self._manager
        need = -(-num_slots // m.block_size)
        if need > self.pool.num_free_blocks:
            return None
        new = self.pool.get_new_blocks(need)
        m.req_to_blocks[request.request_id] = list(new)
        if num_tokens_to_cache is not None and num_tokens_to_cache >= m.block_size:
            m.cache_blocks(request, num_tokens_to_cache)
        return (new,)

    def _get_num_blocks_to_allocate(self, request_id: str, num_tokens: int,
                                    new_computed_blocks: Sequence[Sequence[KVCacheBlock]],
                                    num_encoder_tokens: int, total_computed_tokens: int,
                                    max_blocks: Sequence[int | None] | None = None) -> int:
        return self._manager.get_num_blocks_to_allocate(
            request_id, num_tokens, new_computed_blocks[0], total_computed_tokens,
            None if max_blocks is None else max_blocks[0])

    def _allocate_new_blocks(self, request_id: str, num_tokens: int,
                             num_encoder_tokens: int) -> GroupBlocks:
        return (self._manager.allocate_new_blocks(request_id, num_tokens),)

    def _cache_blocks(self, request: KVRequest, num_tokens: int) -> None:
        self._manager.cache_blocks(request, num_tokens)

    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash], max_length: int,
                               verifier: HitVerifier | None) -> tuple[GroupBlocks, int]:
        m = self._manager
        if not m.enable_caching:
            return ([],), 0
        query = self._query
        query.block_hashes = block_hashes
        query.max_length = max_length
        query.verifier = verifier
        blocks, length = m.find_longest_cache_hit(query)
        return tuple(blocks), length
