"""kvcore: a layered, vLLM-v1-style KV-cache manager with prefix caching.

Layers, top to bottom: ``KVCacheManager`` → coordinator → single-type managers → ``BlockPool``.
The names below are the public API; everything else is internal.
"""

from kvcore import _moved
from kvcore.block_pool import BlockPool
from kvcore.errors import (
    BlockStateError,
    DoubleFreeError,
    InvalidArgumentError,
    InvalidGroupError,
    InvariantError,
    KVCoreError,
    NoFreeBlocksError,
    NullBlockError,
    UnknownHashAlgorithmError,
    UnknownRequestError,
    UnsupportedFeatureError,
)
from kvcore.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVEventBatch,
    decode_event_batch,
    encode_event_batch,
)
from kvcore.eviction import FreeBlockQueue, register_policy
from kvcore.hashing import HASH_ALGORITHMS, BlockHasher, random_seed
from kvcore.invariants import check_invariants, check_manager_invariants
from kvcore.manager import KVCacheManager, PrefixCacheStats
from kvcore.request import Request, RequestBlockHasher
from kvcore.settings import CacheSettings
from kvcore.specs import (
    ChunkedLocalAttentionSpec,
    CircularBufferSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroup,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
    kv_cache_config_from_hf,
    num_blocks_for_memory,
)
from kvcore.types import (
    BlockHash,
    KVCacheBlock,
    KVCacheBlocks,
    KVRequest,
    MultiModalItem,
    NullBlock,
)


def _is_compiled() -> bool:
    """Whether this is the mypyc-compiled build (``KVCORE_COMPILE=1 pip install .``): its hot
    modules, kvcore.manager among them, are then extension modules."""
    from importlib.machinery import EXTENSION_SUFFIXES

    from kvcore import manager

    return (manager.__file__ or "").endswith(tuple(EXTENSION_SUFFIXES))


__compiled__: bool = _is_compiled()
"""True in the mypyc-compiled build, False in the pure-Python package (the reference)."""

_moved.install()  # old import paths keep working one release, with a DeprecationWarning

__all__ = [
    "HASH_ALGORITHMS",
    "AllBlocksCleared",
    "BlockHash",
    "BlockHasher",
    "BlockPool",
    "BlockRemoved",
    "BlockStateError",
    "BlockStored",
    "CacheSettings",
    "ChunkedLocalAttentionSpec",
    "CircularBufferSpec",
    "CrossAttentionSpec",
    "DoubleFreeError",
    "FreeBlockQueue",
    "FullAttentionSpec",
    "InvalidArgumentError",
    "InvalidGroupError",
    "InvariantError",
    "KVCacheBlock",
    "KVCacheBlocks",
    "KVCacheConfig",
    "KVCacheEvent",
    "KVCacheGroup",
    "KVCacheManager",
    "KVCacheSpec",
    "KVCoreError",
    "KVEventBatch",
    "KVRequest",
    "MambaSpec",
    "MultiModalItem",
    "NoFreeBlocksError",
    "NullBlock",
    "NullBlockError",
    "PrefixCacheStats",
    "Request",
    "RequestBlockHasher",
    "SlidingWindowSpec",
    "UnknownHashAlgorithmError",
    "UnknownRequestError",
    "UnsupportedFeatureError",
    "check_invariants",
    "check_manager_invariants",
    "decode_event_batch",
    "encode_event_batch",
    "kv_cache_config_from_hf",
    "num_blocks_for_memory",
    "random_seed",
    "register_policy",
]
