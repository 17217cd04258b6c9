"""KV-cache events and their encoding in vLLM's msgpack wire format.

The pool records an event when blocks enter the prefix cache (:class:`BlockStored`), leave it
(:class:`BlockRemoved`, one per evicted block) or when the whole cache is dropped
(:class:`AllBlocksCleared`).  ``encode_event_batch`` produces the bytes vLLM's
``KVEventBatch`` (``msgspec``, ``array_like`` batch of ``tag``-ged event maps) publishes, so
existing KV-aware routers can consume kvcore's events unchanged.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

import msgspec

MEDIUM_GPU = "GPU"


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Blocks ``block_hashes`` (consecutive, chained onto ``parent_block_hash``) were cached in
    group ``group_id``; ``token_ids`` are their tokens and ``extra_keys`` one entry per block
    (``None`` for a block without extra keys).  ``kv_cache_spec_kind`` (``"full_attention"``,
    ``"sliding_window"``, ...) and ``kv_cache_spec_sliding_window`` describe the group, as
    vLLM's ``KVCacheManager.take_events`` annotates them."""

    block_hashes: tuple[bytes, ...]
    parent_block_hash: bytes | None
    token_ids: tuple[int, ...]
    block_size: int
    group_id: int
    lora_name: str | None = None
    extra_keys: tuple[tuple[Any, ...] | None, ...] | None = None
    medium: str = MEDIUM_GPU
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks with these hashes left group ``group_id``'s prefix cache."""

    block_hashes: tuple[bytes, ...]
    group_id: int
    medium: str = MEDIUM_GPU


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The prefix cache was reset: every cached hash is gone."""


KVCacheEvent: TypeAlias = BlockStored | BlockRemoved | AllBlocksCleared


def untag_extra_keys(keys: tuple[Any, ...] | None) -> tuple[Any, ...] | None:
    """Turn hashing's tagged extra keys (``("lora", name)``, ``("mm", id, offset)``,
    ``("salt", s)``) into the untagged per-block entry vLLM publishes (``name``,
    ``(id, offset)``, ``s``)."""
    if keys is None:
        return None
    return tuple(k[1:] if k[0] == "mm" else k[1] for k in keys)


def _to_wire(event: KVCacheEvent) -> dict[str, Any]:
    # Field order and omitted defaults follow vLLM's msgspec structs (tag first, then fields in
    # declaration order; fields equal to their default are left out).
    if isinstance(event, BlockStored):
        out: dict[str, Any] = {
            "type": "BlockStored",
            "block_hashes": list(event.block_hashes),
            "parent_block_hash": event.parent_block_hash,
            "token_ids": list(event.token_ids),
            "block_size": event.block_size,
            "lora_id": None,
            "medium": event.medium,
            "lora_name": event.lora_name,
        }
        if event.extra_keys is not None:
            out["extra_keys"] = [None if k is None else list(k) for k in event.extra_keys]
        out["group_idx"] = event.group_id
        if event.kv_cache_spec_kind is not None:
            out["kv_cache_spec_kind"] = event.kv_cache_spec_kind
        if event.kv_cache_spec_sliding_window is not None:
            out["kv_cache_spec_sliding_window"] = event.kv_cache_spec_sliding_window
        return out
    if isinstance(event, BlockRemoved):
        return {"type": "BlockRemoved", "block_hashes": list(event.block_hashes),
                "medium": event.medium, "group_idx": event.group_id}
    if isinstance(event, AllBlocksCleared):
        return {"type": "AllBlocksCleared"}
    raise TypeError(f"not a KV-cache event: {event!r}")


def _from_wire(obj: dict[str, Any]) -> KVCacheEvent:
    kind = obj.get("type")
    if kind == "BlockStored":
        extra = obj.get("extra_keys")
        return BlockStored(
            block_hashes=tuple(obj["block_hashes"]),
            parent_block_hash=obj["parent_block_hash"],
            token_ids=tuple(obj["token_ids"]),
            block_size=obj["block_size"],
            group_id=obj.get("group_idx") or 0,
            lora_name=obj.get("lora_name"),
            extra_keys=None if extra is None else tuple(
                None if k is None else tuple(tuple(x) if isinstance(x, list) else x for x in k)
                for k in extra),
            medium=obj.get("medium") or MEDIUM_GPU,
            kv_cache_spec_kind=obj.get("kv_cache_spec_kind"),
            kv_cache_spec_sliding_window=obj.get("kv_cache_spec_sliding_window"),
        )
    if kind == "BlockRemoved":
        return BlockRemoved(block_hashes=tuple(obj["block_hashes"]),
                            group_id=obj.get("group_idx") or 0,
                            medium=obj.get("medium") or MEDIUM_GPU)
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    raise ValueError(f"unknown KV-cache event type {kind!r}")


def encode_event_batch(events: Sequence[KVCacheEvent], ts: float | None = None,
                       data_parallel_rank: int | None = None) -> bytes:
    """Encode ``events`` as one vLLM ``KVEventBatch``: ``[ts, [event, ...](, dp_rank)]``."""
    batch: list[Any] = [time.time() if ts is None else ts, [_to_wire(e) for e in events]]
    if data_parallel_rank is not None:
        batch.append(data_parallel_rank)
    return msgspec.msgpack.encode(batch)


def decode_event_batch(data: bytes) -> tuple[float, list[KVCacheEvent], int | None]:
    """Inverse of :func:`encode_event_batch`: ``(ts, events, data_parallel_rank)``."""
    batch = msgspec.msgpack.decode(data)
    if not isinstance(batch, list) or len(batch) not in (2, 3):
        raise ValueError("not a KV event batch: expected [ts, events(, dp_rank)]")
    rank = batch[2] if len(batch) == 3 else None
    return float(batch[0]), [_from_wire(e) for e in batch[1]], rank
