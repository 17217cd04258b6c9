"""Coordinators (none | unitary | hybrid) and the factory that picks one for a config."""

from __future__ import annotations

from kvcore.block_pool import BlockPool
from kvcore.coordinator.base import KVCacheCoordinator
from kvcore.coordinator.hybrid import HybridCoordinator
from kvcore.coordinator.no_prefix_cache import NoPrefixCacheCoordinator
from kvcore.coordinator.unitary import UnitaryCoordinator
from kvcore.errors import InvalidArgumentError
from kvcore.settings import CacheSettings
from kvcore.specs import KVCacheConfig
from kvcore.types import GroupBlocks


def make_coordinator(config: KVCacheConfig, pool: BlockPool,
                     settings: CacheSettings) -> KVCacheCoordinator:
    """The coordinator for ``config`` over ``pool``: no prefix cache when caching is off,
    unitary for one group, hybrid otherwise."""
    if pool.num_blocks != config.num_blocks or pool.num_groups != config.num_groups:
        raise InvalidArgumentError(
            f"the pool ({pool.num_blocks} blocks, {pool.num_groups} groups) does not fit the "
            f"config ({config.num_blocks} blocks, {config.num_groups} groups)")
    if not settings.enable_caching:
        return NoPrefixCacheCoordinator(config, pool, settings)
    if config.num_groups == 1:
        return UnitaryCoordinator(config, pool, settings)
    return HybridCoordinator(config, pool, settings)


__all__ = ["GroupBlocks", "HybridCoordinator", "KVCacheCoordinator", "NoPrefixCacheCoordinator",
           "UnitaryCoordinator", "make_coordinator"]
