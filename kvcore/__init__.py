"""kvcore: a layered, vLLM-v1-style KV-cache manager with prefix caching.

Layers, top to bottom: ``KVCacheManager`` → coordinator → single-type managers → ``BlockPool``
(``docs/architecture.md``).  The names below are what a scheduler needs to build and drive a
manager; everything else is imported from the module that holds it (errors from
:mod:`kvcore.errors`, events from :mod:`kvcore.events`, eviction policies from
:mod:`kvcore.eviction`, inspection and checks from :mod:`kvcore.testing`).
"""

from kvcore import _moved
from kvcore.errors import KVCoreError
from kvcore.manager import KVCacheManager
from kvcore.request import Request
from kvcore.settings import CacheSettings
from kvcore.specs import (
    ChunkedLocalAttentionSpec,
    CircularBufferSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroup,
    MambaSpec,
    SlidingWindowSpec,
    kv_cache_config_from_hf,
)
from kvcore.types import KVCacheBlocks, KVRequest


def _is_compiled() -> bool:
    """Whether this is the mypyc-compiled build (``pip install .`` where a C compiler is present,
    build_backend/kvcore_build.py): its hot modules, kvcore.manager among them, are then
    extension modules."""
    from importlib.machinery import EXTENSION_SUFFIXES

    from kvcore import manager

    return (manager.__file__ or "").endswith(tuple(EXTENSION_SUFFIXES))


__compiled__: bool = _is_compiled()
"""True in the mypyc-compiled build, False in the pure-Python package (the reference)."""

_moved.install()  # old import paths keep working one release, with a DeprecationWarning

# Names this package exported before its surface was narrowed, and their homes: still served for
# one release, with a DeprecationWarning.
_FORMER: dict[str, str] = {
    **dict.fromkeys(("BlockStateError", "DoubleFreeError", "InvalidArgumentError",
                     "InvalidGroupError", "InvariantError", "NoFreeBlocksError", "NullBlockError",
                     "UnknownHashAlgorithmError", "UnknownRequestError",
                     "UnsupportedFeatureError"), "kvcore.errors"),
    **dict.fromkeys(("AllBlocksCleared", "BlockRemoved", "BlockStored", "KVCacheEvent",
                     "KVEventBatch", "decode_event_batch", "encode_event_batch"), "kvcore.events"),
    **dict.fromkeys(("FreeBlockQueue", "register_policy"), "kvcore.eviction"),
    **dict.fromkeys(("HASH_ALGORITHMS", "BlockHasher", "random_seed"), "kvcore.hashing"),
    **dict.fromkeys(("check_invariants", "check_manager_invariants"), "kvcore.testing"),
    **dict.fromkeys(("BlockHash", "KVCacheBlock", "MultiModalItem", "NullBlock"), "kvcore.types"),
    **dict.fromkeys(("KVCacheSpec", "num_blocks_for_memory"), "kvcore.specs"),
    "BlockPool": "kvcore.block_pool",
    "PrefixCacheStats": "kvcore.manager",
    "RequestBlockHasher": "kvcore.request",
}


__getattr__ = _moved.former_names("kvcore", _FORMER)


__all__ = [
    "CacheSettings",
    "ChunkedLocalAttentionSpec",
    "CircularBufferSpec",
    "CrossAttentionSpec",
    "FullAttentionSpec",
    "KVCacheBlocks",
    "KVCacheConfig",
    "KVCacheGroup",
    "KVCacheManager",
    "KVCoreError",
    "KVRequest",
    "MambaSpec",
    "Request",
    "SlidingWindowSpec",
    "kv_cache_config_from_hf",
]
