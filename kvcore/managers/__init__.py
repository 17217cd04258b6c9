"""Single-type managers, one per KV-cache group, chosen by spec type through a registry.

A new attention type is one new file here plus one line in ``MANAGER_REGISTRY``; code outside
kvcore can pass its own spec -> manager mapping to ``KVCacheManager(manager_classes=...)``.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from kvcore.errors import InvalidArgumentError
from kvcore.managers.base import ManagerContext, SingleTypeKVCacheManager
from kvcore.managers.chunked_local import ChunkedLocalAttentionManager
from kvcore.managers.circular_buffer import CircularBufferManager
from kvcore.managers.cross_attention import CrossAttentionManager
from kvcore.managers.full_attention import FullAttentionManager
from kvcore.managers.mamba import MambaAlignManager, MambaManager
from kvcore.managers.sliding_window import SlidingWindowManager
from kvcore.specs import (
    ChunkedLocalAttentionSpec,
    CircularBufferSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
)

ManagerClasses = Mapping[type[KVCacheSpec], type[SingleTypeKVCacheManager]]

MANAGER_REGISTRY: ManagerClasses = MappingProxyType({
    FullAttentionSpec: FullAttentionManager,
    SlidingWindowSpec: SlidingWindowManager,
    ChunkedLocalAttentionSpec: ChunkedLocalAttentionManager,
    MambaSpec: MambaManager,
    CrossAttentionSpec: CrossAttentionManager,
    CircularBufferSpec: CircularBufferManager,
})


def manager_class_for(spec: KVCacheSpec,
                      overrides: ManagerClasses | None = None) -> type[SingleTypeKVCacheManager]:
    """The manager class for ``spec``'s type (or its nearest registered base class);
    ``overrides`` is consulted before the built-in registry."""
    for cls in type(spec).__mro__:
        if overrides is not None and cls in overrides:
            return overrides[cls]
        if cls in MANAGER_REGISTRY:
            return MANAGER_REGISTRY[cls]
    raise InvalidArgumentError(f"no manager registered for spec type {type(spec).__name__}")


def make_manager(spec: KVCacheSpec, group_id: int, ctx: ManagerContext,
                 overrides: ManagerClasses | None = None) -> SingleTypeKVCacheManager:
    cls = manager_class_for(spec, overrides)
    if (cls is MambaManager and isinstance(spec, MambaSpec)
            and spec.mamba_cache_mode == "align"):
        cls = MambaAlignManager  # the spec's mode picks vLLM's "align" bookkeeping
    return cls(spec, group_id, ctx)


__all__ = [
    "MANAGER_REGISTRY",
    "ChunkedLocalAttentionManager",
    "CircularBufferManager",
    "CrossAttentionManager",
    "FullAttentionManager",
    "MambaAlignManager",
    "MambaManager",
    "ManagerClasses",
    "ManagerContext",
    "SingleTypeKVCacheManager",
    "SlidingWindowManager",
    "make_manager",
    "manager_class_for",
]
