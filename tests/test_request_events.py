"""Request bookkeeping and KV-event encoding."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from kvcore import Request
from kvcore.block_pool import BlockPool
from kvcore.errors import InvalidArgumentError
from kvcore.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVEventBatch,
    decode_event_batch,
    encode_event_batch,
)
from kvcore.types import MultiModalItem
from tests.factories import make_request


def test_request_fields_and_appending() -> None:
    r = Request("r1", [5, 6, 7], max_tokens=4)
    assert (r.request_id, r.num_tokens, r.num_prompt_tokens) == ("r1", 3, 3)
    assert r.prompt_token_ids == [5, 6, 7] and r.output_token_ids == []
    assert r.num_computed_tokens == 0 and r.num_preemptions == 0 and r.block_hashes == []
    assert not r.skip_reading_prefix_cache and r.cache_salt is None and r.lora_name is None
    r.append_output_token_ids(8)
    r.append_output_token_ids([9, 10])
    assert r.output_token_ids == [8, 9, 10] and r.num_tokens == 6 and r.num_output_tokens == 3
    assert r.all_token_ids == [5, 6, 7, 8, 9, 10]
    assert "r1" in repr(r)


@pytest.mark.parametrize("kwargs", [
    {"request_id": "", "prompt_token_ids": [1]},
    {"request_id": "a", "prompt_token_ids": []},
    {"request_id": "a", "prompt_token_ids": [1, -1]},
    {"request_id": "a", "prompt_token_ids": [1, "2"]},
    {"request_id": "a", "prompt_token_ids": [1], "max_tokens": -1},
    {"request_id": "a", "prompt_token_ids": [1, 2], "mm_items": [MultiModalItem("i", 1, 5)]},
    {"request_id": "a", "prompt_token_ids": [1] * 9,
     "mm_items": [MultiModalItem("i", 4, 1), MultiModalItem("j", 1, 1)]},
])
def test_bad_request_arguments(kwargs: dict[str, Any]) -> None:
    with pytest.raises(InvalidArgumentError):
        Request(**kwargs)


def test_bad_output_tokens_change_nothing() -> None:
    r = make_request("a", [1, 2, 3], 2)
    hashes = list(r.block_hashes)
    with pytest.raises(InvalidArgumentError):
        r.append_output_token_ids([4, -5])
    assert r.all_token_ids == [1, 2, 3] and r.block_hashes == hashes


def _sample_events() -> list[KVCacheEvent]:
    return [
        BlockStored(block_hashes=(b"\x01" * 16, b"\x02" * 16), parent_block_hash=None,
                    token_ids=tuple(range(8)), block_size=4, group_id=0),
        BlockStored(block_hashes=(b"\x03" * 16,), parent_block_hash=b"\x02" * 16,
                    token_ids=(1, 2, 3, 4), block_size=4, group_id=1, lora_name="ad",
                    extra_keys=(("ad", ("img", 3), "salt"),)),
        BlockRemoved(block_hashes=(b"\x01" * 16,), group_id=0),
        AllBlocksCleared(),
    ]


def test_event_batch_round_trip() -> None:
    events = _sample_events()
    data = encode_event_batch(events, ts=12.5, data_parallel_rank=3)
    batch = decode_event_batch(data)
    assert (batch.ts, batch.data_parallel_rank) == (12.5, 3)
    assert batch.events == events
    assert [hash(e) for e in batch.events] == [hash(e) for e in events]
    batch = decode_event_batch(encode_event_batch(events, ts=1.0))
    assert batch.data_parallel_rank is None and batch.events == events
    # The structs are the wire format: encoding a batch directly gives the same bytes.
    assert msgspec.msgpack.encode(KVEventBatch(12.5, events, 3)) == data


def test_events_are_frozen_and_keep_python_names() -> None:
    ev = BlockRemoved(block_hashes=(b"\x01" * 16,), group_id=2)
    assert ev.group_id == 2 and ev.medium == "GPU"
    with pytest.raises(AttributeError):
        ev.group_id = 3  # type: ignore[misc]  # frozen: the assignment must fail
    moved = msgspec.structs.replace(ev, group_id=3)
    assert moved.group_id == 3 and ev.group_id == 2
    with pytest.raises(TypeError):
        BlockRemoved((b"\x01" * 16,))  # type: ignore[call-arg]  # keyword-only fields


def test_event_wire_layout_matches_vllm_shape() -> None:
    """vLLM's KVEventBatch is an array [ts, events]; each event is a map tagged by "type" with
    the fields in declaration order and defaults omitted."""
    raw = msgspec.msgpack.decode(encode_event_batch(_sample_events(), ts=2.0))
    assert raw[0] == 2.0 and raw[2] is None and len(raw) == 3  # vLLM encodes a None rank too
    stored, stored2, removed, cleared = raw[1]
    assert list(stored) == ["type", "block_hashes", "parent_block_hash", "token_ids",
                            "block_size", "lora_id", "medium", "lora_name", "group_idx"]
    assert stored["type"] == "BlockStored" and stored["medium"] == "GPU"
    assert stored2["extra_keys"] == [["ad", ["img", 3], "salt"]]
    assert removed == {"type": "BlockRemoved", "block_hashes": [b"\x01" * 16], "medium": "GPU",
                       "group_idx": 0}
    assert cleared == {"type": "AllBlocksCleared"}


def test_decode_rejects_garbage() -> None:
    with pytest.raises(ValueError):
        decode_event_batch(msgspec.msgpack.encode({"a": 1}))
    with pytest.raises(ValueError):
        decode_event_batch(msgspec.msgpack.encode([1.0, [{"type": "Nope"}]]))
    for events in ([["Nope", 1]], [[]], [["BlockRemoved", [1], "GPU", 0, None, None, 7]],
                   [["BlockStored", "not hashes"]], [3]):
        with pytest.raises(ValueError):
            decode_event_batch(msgspec.msgpack.encode([1.0, events, 0]))


def test_decode_reads_the_positional_encoding_too() -> None:
    """vLLM before 0.26 (and the publisher's ``encoding="array"``) sent ``[tag, field, ...]``
    arrays in declaration order with trailing defaults left out: they decode into the same
    events as the tagged maps."""
    from kvcore.events.publisher import encode_payload

    events = _sample_events()
    for ints in (True, False):
        as_maps = decode_event_batch(encode_payload(events, 2.5, int_block_hashes=ints))
        as_arrays = decode_event_batch(
            encode_payload(events, 2.5, int_block_hashes=ints, encoding="array"))
        assert as_arrays == as_maps and len(as_maps.events) == len(events)
    old = [1.0, [["BlockStored", [7, 8], 6, [1, 2, 3, 4], 2, None, "CPU"],
                 ["BlockRemoved", [7]], ["AllBlocksCleared"]], 1]
    batch = decode_event_batch(msgspec.msgpack.encode(old))
    stored, removed, cleared = batch.events
    assert isinstance(stored, BlockStored) and stored.block_hashes == (7, 8)
    assert (stored.parent_block_hash, stored.token_ids, stored.medium) == (6, (1, 2, 3, 4), "CPU")
    assert stored.group_id is None and isinstance(removed, BlockRemoved)
    assert removed.medium == "GPU" and type(cleared).__name__ == "AllBlocksCleared"
    from kvcore.cluster import KVRoutingIndex

    index = KVRoutingIndex()  # the routing index reads such a stream as well
    index.apply_payload(0, msgspec.msgpack.encode([1.0, old[1][:1], 0]), seq=0)
    assert index.holders(7) == {0: {"CPU": 1}} and index.num_blocks(0, "CPU") == 2


def test_decode_reads_everything_vllm_publishes() -> None:
    """vLLM 0.32 may publish int hashes, bytes digests among the extra keys, no group, and
    fields kvcore never sets (session_id, locality, ownership); all of it decodes."""
    stored = {"type": "BlockStored", "block_hashes": [7, 8], "parent_block_hash": 6,
              "token_ids": [1, 2, 3, 4], "block_size": 2, "lora_id": 5, "medium": "CPU",
              "lora_name": "ad", "extra_keys": [["ad", ["img", 0], b"\x00\x01"], None],
              "locality": "LOCAL", "session_id": "s1"}
    removed = {"type": "BlockRemoved", "block_hashes": [b"\x09"], "medium": None,
               "ownership": "tier2"}
    batch = decode_event_batch(msgspec.msgpack.encode([3, [stored, removed], 1]))
    ev, rem = batch.events
    assert isinstance(ev, BlockStored) and isinstance(rem, BlockRemoved)
    assert ev.block_hashes == (7, 8) and ev.group_id is None and ev.lora_id == 5
    assert ev.extra_keys == (("ad", ("img", 0), b"\x00\x01"), None)
    assert (ev.locality, ev.session_id, rem.ownership, rem.medium) == ("LOCAL", "s1", "tier2", None)
    assert msgspec.msgpack.decode(encode_event_batch(batch.events, ts=3.0, data_parallel_rank=1)) == [
        3.0, [stored, removed], 1]


def test_pool_events_carry_untagged_extra_keys_and_lora() -> None:
    pool = BlockPool(6, enable_events=True)
    req = make_request("a", list(range(8)), 4, lora_name="ad", cache_salt="s",
                       mm_items=(MultiModalItem("img", 5, 2),))
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(req, blocks, 0, 2, 4, 0)
    (ev,) = pool.take_events()
    assert isinstance(ev, BlockStored)
    assert ev.lora_name == "ad"
    assert ev.extra_keys == (("ad", "s"), ("ad", ("img", 1)))
    assert decode_event_batch(encode_event_batch([ev])).events == [ev]


def test_events_disabled_records_nothing() -> None:
    pool = BlockPool(6)
    req = make_request("a", list(range(8)), 4)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(req, blocks, 0, 2, 4, 0)
    pool.free_blocks(blocks)
    pool.get_new_blocks(5)
    assert pool.reset_prefix_cache() is False
    assert pool.take_events() == []
