"""Coordinator for prefix caching off: no hits, nothing cached, any number of groups."""

from __future__ import annotations

from collections.abc import Sequence

from kvcore.coordinator.base import KVCacheCoordinator
from kvcore.types import BlockHash, GroupBlocks
from kvcore.verify import HitVerifier


class NoPrefixCacheCoordinator(KVCacheCoordinator):
    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash], max_length: int,
                               verifier: HitVerifier | None) -> tuple[GroupBlocks, int, int]:
        return tuple([] for _ in self.managers), 0, 0
