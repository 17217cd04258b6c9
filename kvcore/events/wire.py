"""KV-cache events, as ``msgspec`` structs whose encoding is vLLM's wire format.

The pool records an event when blocks enter the prefix cache (:class:`BlockStored`), leave it
(:class:`BlockRemoved`, one per evicted block) or when the whole cache is dropped
(:class:`AllBlocksCleared`).  The classes mirror vLLM 0.33's ``vllm.distributed.kv_events``
field for field (0.33's ``lookahead_token_ids`` included): each event is a msgpack map tagged ``"type": "<ClassName>"`` with the fields in
vLLM's declaration order and ``None`` defaults left out, and :class:`KVEventBatch` is the array
``[ts, [event, ...], data_parallel_rank]``.  So ``msgspec.msgpack.encode(batch)`` produces the
bytes vLLM publishes, existing KV-aware routers consume kvcore's events unchanged, and
:func:`decode_event_batch` reads a vLLM 0.32 or 0.33 batch back into these classes.

One name differs from the wire: the KV-cache group is the attribute ``group_id`` (as everywhere
in kvcore) and is encoded as vLLM's ``group_idx``.  Events are frozen; derive a changed copy
with ``msgspec.structs.replace``.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any, TypeAlias

import msgspec

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"  # a host-memory tier

ExternalBlockHash: TypeAlias = bytes | int
"""A block hash as published: kvcore's ``bytes``; vLLM may publish 64-bit ints instead."""


def _medium_gpu() -> str:
    return MEDIUM_GPU


def _no_value() -> None:
    return None


# ``lora_id``, ``medium`` and ``lora_name`` are required fields in vLLM, so vLLM's decoder rejects
# an event without them: they must always be encoded.  ``omit_defaults`` leaves out a field that
# equals a plain default, but never one whose default comes from a factory like these, so the
# factories give kvcore's constructors convenient defaults while keeping the fields on the wire.
_ALWAYS_NONE: Any = msgspec.field(default_factory=_no_value)


class KVCacheEventBase(msgspec.Struct, frozen=True, omit_defaults=True, gc=False, tag=True):
    """Base of the event structs (vLLM's ``KVCacheEvent``): tagged by class name, ``None``
    defaults omitted; no reference cycles, so instances skip the garbage collector."""


class BlockStored(KVCacheEventBase, frozen=True, kw_only=True):
    """Blocks ``block_hashes`` (consecutive, chained onto ``parent_block_hash``) were cached in
    group ``group_id``; ``token_ids`` are their tokens and ``extra_keys`` one entry per block
    (``None`` for a block without extra keys; untagged, see :func:`untag_extra_keys`).
    ``kv_cache_spec_kind`` (``"full_attention"``, ``"sliding_window"``, ...) and
    ``kv_cache_spec_sliding_window`` describe the group, as ``KVCacheManager.take_events``
    annotates them.  ``session_id`` is the storing request's (as vLLM sends it; it names
    who stored or reused the block, not who owns it).  ``lookahead_token_ids`` (vLLM 0.33):
    with lookahead hashes, per stored block the tokens after it that its hash covers (its
    ``extra_keys`` then cover that window too); ``None`` without.  ``lora_id`` (deprecated in
    vLLM), ``locality`` and ``ownership`` exist for vLLM's events; kvcore leaves them ``None``."""

    block_hashes: tuple[ExternalBlockHash, ...]
    parent_block_hash: ExternalBlockHash | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None = _ALWAYS_NONE
    medium: str | None = msgspec.field(default_factory=_medium_gpu)
    lora_name: str | None = _ALWAYS_NONE
    # Entries are free-form on the wire (names, (mm id, offset) pairs, digests); see
    # decode_event_batch for how nested arrays come back.
    extra_keys: tuple[tuple[Any, ...] | None, ...] | None = None
    group_id: int | None = msgspec.field(default=None, name="group_idx")
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: tuple[tuple[int, ...], ...] | None = None


class BlockRemoved(KVCacheEventBase, frozen=True, kw_only=True):
    """Blocks with these hashes left group ``group_id``'s prefix cache."""

    block_hashes: tuple[ExternalBlockHash, ...]
    medium: str | None = msgspec.field(default_factory=_medium_gpu)
    group_id: int | None = msgspec.field(default=None, name="group_idx")
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEventBase, frozen=True):
    """The prefix cache was reset: every cached hash is gone."""


KVCacheEvent: TypeAlias = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One published batch (vLLM's ``KVEventBatch``), encoded as an array.  As with vLLM's
    struct, a ``None`` rank is still encoded (``omit_defaults`` does not apply to arrays)."""

    ts: float
    events: list[KVCacheEvent]
    data_parallel_rank: int | None = None


def untag_extra_keys(keys: tuple[Any, ...] | None) -> tuple[Any, ...] | None:
    """Turn hashing's tagged extra keys (``("lora", name)``, ``("mm", id, offset)``,
    ``("salt", s)``) into the untagged per-block entry vLLM publishes (``name``,
    ``(id, offset)``, ``s``)."""
    if keys is None:
        return None
    return tuple(k[1:] if k[0] == "mm" else k[1] for k in keys)


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(KVEventBatch)


def encode_event_batch(events: Iterable[KVCacheEvent], ts: float | None = None,
                       data_parallel_rank: int | None = None) -> bytes:
    """Encode ``events`` as one :class:`KVEventBatch` (``ts`` defaults to now)."""
    return _encoder.encode(KVEventBatch(time.time() if ts is None else ts, list(events),
                                        data_parallel_rank))


def _as_tuples(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return tuple(_as_tuples(v) for v in value)
    return value


_EVENT_TYPES: dict[str, type[KVCacheEventBase]] = {
    cls.__name__: cls for cls in (BlockStored, BlockRemoved, AllBlocksCleared)}


def _decode_arrays(data: bytes) -> KVEventBatch:
    """A batch whose events are positional arrays (vLLM before 0.26, kvcore's
    ``encoding="array"``): each ``[tag, field, ...]`` in declaration order, trailing defaults
    left out.  Raises ``msgspec.ValidationError`` for anything else."""
    raw = msgspec.msgpack.decode(data)
    if not (isinstance(raw, list) and 2 <= len(raw) <= 3 and isinstance(raw[1], list)):
        raise msgspec.ValidationError("not an event batch: expected [ts, events, rank]")
    events: list[Any] = []
    for item in raw[1]:
        cls = _EVENT_TYPES.get(item[0]) if isinstance(item, list) and item else None
        if cls is None:
            raise msgspec.ValidationError(f"not a tagged event array: {item!r:.80}")
        names = [f.encode_name for f in msgspec.structs.fields(cls)]
        if len(item) - 1 > len(names):
            raise msgspec.ValidationError(f"{item[0]} has {len(item) - 1} fields, at most "
                                          f"{len(names)} expected")
        events.append({"type": item[0], **dict(zip(names, item[1:]))})
    return msgspec.convert([raw[0], events, *raw[2:]], KVEventBatch)


def decode_event_batch(data: bytes) -> KVEventBatch:
    """Decode a batch published by kvcore or vLLM (tagged maps as vLLM 0.26+ sends them, or
    the older positional arrays) into these classes.

    Raises ``msgspec.DecodeError`` (a ``ValueError``) for bytes that are not such a batch.
    ``extra_keys`` entries have no fixed type on the wire, so their nested arrays (an
    ``(mm id, offset)`` pair) are turned back into tuples here: decoded events then equal, and
    hash like, the events that were encoded.
    """
    try:
        batch = _decoder.decode(data)
    except msgspec.ValidationError:  # maybe the positional encoding: [tag, field, ...]
        batch = _decode_arrays(data)
    events = batch.events
    for i, event in enumerate(events):
        if isinstance(event, BlockStored) and event.extra_keys:
            events[i] = msgspec.structs.replace(event, extra_keys=_as_tuples(event.extra_keys))
    return batch
