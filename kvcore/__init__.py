"""kvcore: a layered, vLLM-v1-style KV-cache manager with prefix caching.

Layers, top to bottom: ``KVCacheManager`` → coordinator → single-type managers → ``BlockPool``.
The names below are the public API; everything else is internal.
"""

from kvcore.block_pool import BlockPool
from kvcore.blocks import BlockHash, FreeBlockQueue, KVCacheBlock, NullBlock
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
)
from kvcore.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    decode_event_batch,
    encode_event_batch,
)
from kvcore.hashing import HASH_ALGORITHMS, BlockHasher, RequestBlockHasher, random_seed
from kvcore.invariants import check_invariants
from kvcore.request import KVRequest, MultiModalItem, Request

__all__ = [
    "HASH_ALGORITHMS",
    "AllBlocksCleared",
    "BlockHash",
    "BlockHasher",
    "BlockPool",
    "BlockRemoved",
    "BlockStateError",
    "BlockStored",
    "DoubleFreeError",
    "FreeBlockQueue",
    "InvalidArgumentError",
    "InvalidGroupError",
    "InvariantError",
    "KVCacheBlock",
    "KVCacheEvent",
    "KVCoreError",
    "KVRequest",
    "MultiModalItem",
    "NoFreeBlocksError",
    "NullBlock",
    "NullBlockError",
    "Request",
    "RequestBlockHasher",
    "UnknownHashAlgorithmError",
    "UnknownRequestError",
    "check_invariants",
    "decode_event_batch",
    "encode_event_batch",
    "random_seed",
]
