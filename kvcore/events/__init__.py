"""KV-cache events: the wire types (:mod:`kvcore.events.wire`, vLLM's format) and the recorder
that makes them where they happen (:mod:`kvcore.events.recorder`)."""

from __future__ import annotations

from kvcore.events.recorder import EventRecorder, GroupStamp
from kvcore.events.wire import (
    MEDIUM_CPU,
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    ExternalBlockHash,
    KVCacheEvent,
    KVCacheEventBase,
    KVEventBatch,
    decode_event_batch,
    encode_event_batch,
    untag_extra_keys,
)

__all__ = [
    "MEDIUM_CPU",
    "MEDIUM_GPU",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EventRecorder",
    "ExternalBlockHash",
    "GroupStamp",
    "KVCacheEvent",
    "KVCacheEventBase",
    "KVEventBatch",
    "decode_event_batch",
    "encode_event_batch",
    "untag_extra_keys",
]
