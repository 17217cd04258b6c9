"""Coordinator for one KV-cache group: the group's own hit rule is the answer."""

from __future__ import annotations

from collections.abc import Sequence

from kvcore.blocks import BlockHash
from kvcore.coordinator.base import GroupBlocks, KVCacheCoordinator
from kvcore.errors import InvalidArgumentError
from kvcore.managers import ManagerClasses
from kvcore.specs import KVCacheConfig


class UnitaryCoordinator(KVCacheCoordinator):
    def __init__(self, config: KVCacheConfig, *, enable_events: bool = False,
                 verify_hits: bool = False, manager_classes: ManagerClasses | None = None) -> None:
        if config.num_groups != 1:
            raise InvalidArgumentError(
                f"UnitaryCoordinator needs exactly one group, got {config.num_groups}")
        super().__init__(config, enable_caching=True, enable_events=enable_events,
                         verify_hits=verify_hits, alignment_tokens=config.groups[0].spec.block_size,
                         manager_classes=manager_classes)
        self._manager = self.managers[0]
        self._group_ids = (0,)

    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash], max_length: int,
                               token_ids: Sequence[int] | None) -> tuple[GroupBlocks, int]:
        m = self._manager
        if not m.enable_caching:
            return ([],), 0
        blocks, length = m.find_longest_cache_hit(block_hashes, max_length, self._group_ids,
                                                  self.pool, m.spec, m.block_size, token_ids)
        return tuple(blocks), length
