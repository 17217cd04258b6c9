"""KV events on the wire against vLLM 0.32 itself (the peer venv, run as a subprocess).

kvcore's batches must decode into vLLM's own ``KVEventBatch`` classes and re-encode to the very
same msgpack values (maps with the same keys in the same order, the same values), and batches
vLLM encodes (with fields kvcore never sets) must decode into kvcore's classes and re-encode
the same way.  Not the same bytes: msgspec sizes a struct's map header by how many fields the
class has, and kvcore's ``BlockStored`` mirrors vLLM 0.33's 16 fields (``lookahead_token_ids``
is new), where 0.32's 15 get the one-byte header.  Byte identity with vLLM 0.33 is tested in
its own venv (``tests/integrations/vllm/test_adapter.py``).  Skipped without the peer venv (a
failure in CI), like ``test_vs_vllm``.
"""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
import time
from typing import Any

import msgspec
import pytest

from kvcore.connector.host_tier import HostOffloadingManager
from kvcore.events import KVCacheEvent, decode_event_batch, encode_event_batch
from kvcore.types import MultiModalItem
from tests.differential.test_vs_vllm import _peer
from tests.factories import admit, full_spec, make_manager, swa_spec

_PEER_SCRIPT = textwrap.dedent("""
    import json, sys
    import msgspec
    from vllm.distributed.kv_events import (
        AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch)

    FIELDS = ("medium", "lora_name", "session_id", "block_size", "token_ids",
              "parent_block_hash", "kv_cache_spec_sliding_window")
    def js(v):
        if isinstance(v, bytes):
            return v.hex()
        return [js(x) for x in v] if isinstance(v, (list, tuple)) else v

    def ordered(v):  # msgpack values with maps as item lists: key order counts
        if isinstance(v, dict):
            return [[k, ordered(x)] for k, x in v.items()]
        return [ordered(x) for x in v] if isinstance(v, list) else v
    decoder = msgspec.msgpack.Decoder(KVEventBatch)
    encoder = msgspec.msgpack.Encoder()
    ours = bytes.fromhex(sys.stdin.read().strip())
    batch = decoder.decode(ours)
    out = {
        "same_values": (ordered(msgspec.msgpack.decode(encoder.encode(batch)))
                        == ordered(msgspec.msgpack.decode(ours))),
        "types": [type(e).__name__ for e in batch.events],
        "groups": [getattr(e, "group_idx", None) for e in batch.events],
        "kinds": [getattr(e, "kv_cache_spec_kind", None) for e in batch.events],
        "rank": batch.data_parallel_rank,
        "fields": [[js(getattr(e, f, None)) for f in FIELDS] for e in batch.events],
    }
    theirs = KVEventBatch(ts=5.0, data_parallel_rank=2, events=[
        BlockStored(block_hashes=[11, 12], parent_block_hash=10, token_ids=[1, 2, 3, 4],
                    block_size=2, lora_id=3, medium="CPU", lora_name="ad",
                    extra_keys=[("ad", ("img", 0), b"\\x00\\x01"), None], group_idx=1,
                    kv_cache_spec_kind="full_attention", locality="LOCAL", session_id="s"),
        BlockStored(block_hashes=[b"\\x05"], parent_block_hash=None, token_ids=[9, 9],
                    block_size=2, lora_id=None, medium=None, lora_name=None),
        BlockRemoved(block_hashes=[11], medium="CPU", ownership="tier2"),
        AllBlocksCleared(),
    ])
    out["theirs"] = encoder.encode(theirs).hex()
    print(json.dumps(out))
""")


FIELDS = ("medium", "lora_name", "session_id", "block_size", "token_ids", "parent_block_hash",
          "kv_cache_spec_sliding_window")


def _event_stream() -> list[KVCacheEvent]:
    """A manager's events: two groups (full + sliding window), LoRA, multimodal and salt keys,
    a session id, evictions and a reset; then a host tier's (``medium="CPU"``) stores and
    evictions."""
    m = make_manager(full_spec(4), swa_spec(8, 4), num_blocks=12, enable_events=True)
    a = m.make_request("a", range(14), lora_name="ad", cache_salt="s",
                       mm_items=(MultiModalItem("img", 5, 2),), session_id="chat-7")
    assert admit(m, a) is not None
    m.free(a)
    b = m.make_request("b", range(100, 118))
    assert admit(m, b) is not None  # evicts some of a's blocks
    m.free(b)
    assert m.reset_prefix_cache()
    events = m.take_events()
    assert {type(e).__name__ for e in events} == {"BlockStored", "BlockRemoved",
                                                   "AllBlocksCleared"}
    assert {getattr(e, "session_id", None) for e in events} == {None, "chat-7"}
    host = HostOffloadingManager(2, 4)
    for keys in ([(0, a.block_hashes[0]), (1, a.block_hashes[1])], [(0, b.block_hashes[0])]):
        out = host.prepare_store(keys)
        assert out is not None
        host.complete_store(out.keys_to_store)
    cpu = host.take_events()
    assert {e.medium for e in cpu} == {"CPU"} and len(cpu) == 4  # 2 stores, 1 eviction, 1 store
    return [*events, *cpu]


def _fields(e: KVCacheEvent) -> list[Any]:
    """``FIELDS`` of ``e`` as the peer script reports vLLM's decoded values (bytes as hex)."""
    def js(v: Any) -> Any:
        if isinstance(v, bytes):
            return v.hex()
        return [js(x) for x in v] if isinstance(v, (list, tuple)) else v

    return [js(getattr(e, f, None)) for f in FIELDS]


def _run_peer(data: bytes) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": "", "VLLM_LOGGING_LEVEL": "ERROR"}
    proc = subprocess.run([str(_peer()), "-c", _PEER_SCRIPT], input=data.hex(),
                          capture_output=True, text=True, env=env, timeout=600)
    if proc.returncode != 0:
        pytest.fail(f"vLLM peer failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def test_event_bytes_are_vllm_wire_format_both_ways() -> None:
    events = _event_stream()
    ours = encode_event_batch(events, ts=1.5, data_parallel_rank=0)
    peer = _run_peer(ours)
    # vLLM decodes kvcore's bytes into its classes and re-encodes the same values.
    assert peer["same_values"]
    assert peer["types"] == [type(e).__name__ for e in events]
    assert peer["groups"] == [getattr(e, "group_id", None) for e in events]
    assert peer["kinds"] == [getattr(e, "kv_cache_spec_kind", None) for e in events]
    assert peer["fields"] == [_fields(e) for e in events]  # session ids, media, tokens, ...
    assert peer["rank"] == 0
    # vLLM's bytes (int hashes, CPU medium, fields kvcore never sets) decode into kvcore's
    # classes and re-encode the same values.
    theirs = bytes.fromhex(peer["theirs"])
    batch = decode_event_batch(theirs)
    again = encode_event_batch(batch.events, ts=batch.ts,
                               data_parallel_rank=batch.data_parallel_rank)
    assert _ordered(msgspec.msgpack.decode(again)) == _ordered(msgspec.msgpack.decode(theirs))


def _ordered(v: Any) -> Any:
    """A decoded msgpack value with maps as lists of items (so key order counts)."""
    if isinstance(v, dict):
        return [[k, _ordered(x)] for k, x in v.items()]
    return [_ordered(x) for x in v] if isinstance(v, list) else v


_PEER_INT_HASHES = textwrap.dedent("""
    import json, os, sys
    os.environ["VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"] = "1"
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
    print(json.dumps([maybe_convert_block_hash(bytes.fromhex(h)) for h in json.load(sys.stdin)]))
""")


def test_published_batches_are_what_vllm_publishes() -> None:
    """Through the real publisher (PUB framing, replay socket): vLLM decodes each payload and
    re-encodes the same values, and the int hashes are vLLM's own ``maybe_convert_block_hash``."""
    import zmq

    from kvcore.events import BlockRemoved, BlockStored
    from kvcore.events.publisher import ZmqEventPublisher, to_external

    events = _event_stream()
    with ZmqEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*") as pub:
        assert pub.replay_endpoint is not None
        pub.publish(events, ts=1.5)
        # The publisher's thread sends (and buffers) the batch on its own time: ask for its
        # replay once it is out, or the answer is the "nothing from there" end marker.
        deadline = time.monotonic() + 10
        while pub.num_published < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.connect(pub.replay_endpoint)
        sock.send_multipart((b"", (0).to_bytes(8, "big")))
        assert sock.poll(5000)
        _, topic, seq, payload = sock.recv_multipart()
        ctx.destroy(linger=0)
    assert (topic, int.from_bytes(seq, "big")) == (b"", 0)
    peer = _run_peer(payload)
    assert peer["same_values"] and peer["rank"] == 0
    assert peer["types"] == [type(e).__name__ for e in events]
    raw = [h for e in events if isinstance(e, (BlockStored, BlockRemoved))
           for h in e.block_hashes if isinstance(h, bytes)]
    env = {**os.environ, "PYTHONPATH": "", "VLLM_LOGGING_LEVEL": "ERROR"}
    proc = subprocess.run([str(_peer()), "-c", _PEER_INT_HASHES],
                          input=json.dumps([h.hex() for h in raw]), capture_output=True,
                          text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    theirs = json.loads(proc.stdout.strip().splitlines()[-1])
    ours = [h for e in decode_event_batch(payload).events
            if isinstance(e, (BlockStored, BlockRemoved)) for h in e.block_hashes]
    assert ours == theirs and all(isinstance(h, int) for h in ours)
    assert decode_event_batch(payload).events == [to_external(e, True) for e in events]
