"""Coordinator for prefix caching off: no hits, nothing cached, any number of groups."""

from __future__ import annotations

from collections.abc import Sequence

from kvcore.blocks import BlockHash
from kvcore.coordinator.base import GroupBlocks, KVCacheCoordinator
from kvcore.managers import ManagerClasses
from kvcore.specs import KVCacheConfig
from kvcore.verify import HitVerifier


class NoPrefixCacheCoordinator(KVCacheCoordinator):
    def __init__(self, config: KVCacheConfig, *, enable_events: bool = False,
                 use_eagle: bool = False, manager_classes: ManagerClasses | None = None,
                 eviction_policy: object = "lru") -> None:
        super().__init__(config, enable_caching=False, enable_events=enable_events,
                         verify_hits=False, alignment_tokens=config.alignment_tokens,
                         use_eagle=use_eagle, manager_classes=manager_classes,
                         eviction_policy=eviction_policy)

    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash], max_length: int,
                               verifier: HitVerifier | None) -> tuple[GroupBlocks, int]:
        return tuple([] for _ in self.managers), 0
