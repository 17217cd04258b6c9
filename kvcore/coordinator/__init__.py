"""Coordinators (none | unitary | hybrid) and the factory that picks one for a config."""

from __future__ import annotations

from kvcore.coordinator.base import GroupBlocks, KVCacheCoordinator
from kvcore.coordinator.hybrid import HybridCoordinator
from kvcore.coordinator.no_prefix_cache import NoPrefixCacheCoordinator
from kvcore.coordinator.unitary import UnitaryCoordinator
from kvcore.managers import ManagerClasses
from kvcore.specs import KVCacheConfig


def make_coordinator(config: KVCacheConfig, *, enable_caching: bool = True,
                     enable_events: bool = False, verify_hits: bool = False,
                     use_eagle: bool = False, manager_classes: ManagerClasses | None = None,
                     eviction_policy: object = "lru") -> KVCacheCoordinator:
    """No prefix cache when caching is off; unitary for one group; hybrid otherwise."""
    if not enable_caching:
        return NoPrefixCacheCoordinator(config, enable_events=enable_events, use_eagle=use_eagle,
                                        manager_classes=manager_classes,
                                        eviction_policy=eviction_policy)
    if config.num_groups == 1:
        return UnitaryCoordinator(config, enable_events=enable_events, verify_hits=verify_hits,
                                  use_eagle=use_eagle, manager_classes=manager_classes,
                                  eviction_policy=eviction_policy)
    return HybridCoordinator(config, enable_events=enable_events, verify_hits=verify_hits,
                             use_eagle=use_eagle, manager_classes=manager_classes,
                             eviction_policy=eviction_policy)


__all__ = ["GroupBlocks", "HybridCoordinator", "KVCacheCoordinator", "NoPrefixCacheCoordinator",
           "UnitaryCoordinator", "make_coordinator"]
