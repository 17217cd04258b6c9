"""KV events over ZeroMQ (``kvcore.events.publisher``): real PUB/SUB and ROUTER sockets on localhost."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator

import msgspec
import pytest
import zmq

from kvcore.errors import InvalidArgumentError
from kvcore.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    decode_event_batch,
)
from kvcore.events.publisher import (
    END_SEQ,
    PublisherClosedError,
    ZmqEventPublisher,
    external_hash,
    to_external,
)
from kvcore.sim.replay import ReplayConfig, replay
from kvcore.sim.workloads import shared_prefix
from tests.factories import admit, full_spec, make_manager

LOCAL = "tcp://127.0.0.1:*"
TIMEOUT_MS = 5000


@pytest.fixture
def ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield context
    context.destroy(linger=0)


def manager_batches() -> list[list[KVCacheEvent]]:
    """Event batches of a small manager run: stores, evictions and a reset."""
    m = make_manager(full_spec(4), num_blocks=8, enable_events=True)
    batches = []
    for i, base in enumerate((0, 100, 200)):
        req = m.make_request(f"r{i}", range(base, base + 14))
        assert admit(m, req) is not None
        m.free(req)
        batches.append(m.take_events())
    assert m.reset_prefix_cache()
    batches.append(m.take_events())
    assert all(batches) and any(isinstance(e, BlockRemoved) for b in batches for e in b)
    return batches


def request_replay(ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str,
                   start: int) -> list[tuple[bytes, int, bytes]]:
    """Ask the replay socket for every batch from ``start``: (topic, seq, payload) each."""
    sock = ctx.socket(zmq.DEALER)
    sock.connect(endpoint)
    sock.send_multipart((b"", start.to_bytes(8, "big")))
    out = []
    while True:
        assert sock.poll(TIMEOUT_MS), "no reply from the replay socket"
        empty, topic, seq, payload = sock.recv_multipart()
        assert empty == b""
        if seq == END_SEQ:
            assert (topic, payload) == (b"", b"")
            break
        assert len(seq) == 8, seq  # vLLM's frame: 8 bytes, big-endian
        out.append((topic, int.from_bytes(seq, "big"), payload))
    sock.close(linger=0)
    return out


def wait_until_published(pub: ZmqEventPublisher, n: int) -> None:
    for _ in range(500):
        if pub.num_published >= n:
            return
        threading.Event().wait(0.01)
    raise AssertionError(f"{pub.num_published} of {n} batches published")


def test_a_subscriber_receives_and_decodes_the_stream(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    batches = manager_batches()
    with ZmqEventPublisher(LOCAL, topic="kv", data_parallel_rank=3) as pub:
        assert pub.endpoint.startswith("tcp://127.0.0.1:") and not pub.endpoint.endswith("*")
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"kv")
        sub.connect(pub.endpoint)
        # A SUB socket misses what is sent before it is connected (ZeroMQ's slow joiner):
        # probe until one batch arrives, then publish the run.
        probes = 0
        while not sub.poll(20):
            pub.publish([AllBlocksCleared()])
            probes += 1
            assert probes < 250, "the subscriber never connected"
        first = int.from_bytes(sub.recv_multipart()[1], "big")
        while sub.poll(100):  # drain the other probes in flight
            first = int.from_bytes(sub.recv_multipart()[1], "big")
        for batch in batches:
            assert pub.publish(batch, ts=1.5)
        received = []
        for _ in batches:
            assert sub.poll(TIMEOUT_MS)
            topic, seq, payload = sub.recv_multipart()
            assert len(seq) == 8, seq  # vLLM's frame: 8 bytes, big-endian
            received.append((topic, int.from_bytes(seq, "big"), decode_event_batch(payload)))
        sub.close(linger=0)
    assert [t for t, _, _ in received] == [b"kv"] * len(batches)
    assert [s for _, s, _ in received] == list(range(first + 1, first + 1 + len(batches)))
    for (_, _, got), sent in zip(received, batches, strict=True):
        assert got.ts == 1.5 and got.data_parallel_rank == 3
        assert got.events == [to_external(e, True) for e in sent]
    assert pub.num_dropped == 0


def test_a_late_subscriber_recovers_every_buffered_batch(
        ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    batches = manager_batches()
    with ZmqEventPublisher(LOCAL, LOCAL, topic="t") as pub:
        assert pub.replay_endpoint is not None
        for batch in batches:
            pub.publish(batch)
        wait_until_published(pub, len(batches))
        replayed = request_replay(ctx, pub.replay_endpoint, 0)
        assert [seq for _, seq, _ in replayed] == list(range(len(batches)))
        assert all(topic == b"t" for topic, _, _ in replayed)
        for (_, _, payload), sent in zip(replayed, batches, strict=True):
            assert decode_event_batch(payload).events == [to_external(e, True) for e in sent]
        # From a later sequence number, and past the end: only the rest, then the end marker.
        assert [seq for _, seq, _ in request_replay(ctx, pub.replay_endpoint, 2)] == [2, 3]
        assert request_replay(ctx, pub.replay_endpoint, 99) == []


def test_the_replay_buffer_keeps_the_last_buffer_steps_batches(
        ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    with ZmqEventPublisher(LOCAL, LOCAL, buffer_steps=3) as pub:
        assert pub.replay_endpoint is not None
        for i in range(7):
            pub.publish([BlockRemoved(block_hashes=(bytes([i]) * 16,))])
        wait_until_published(pub, 7)
        assert [seq for _, seq, _ in request_replay(ctx, pub.replay_endpoint, 0)] == [4, 5, 6]


def test_a_malformed_replay_request_is_ignored_and_the_socket_keeps_serving(
        ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    with ZmqEventPublisher(LOCAL, LOCAL) as pub:
        assert pub.replay_endpoint is not None
        pub.publish([AllBlocksCleared()])
        wait_until_published(pub, 1)
        bad = ctx.socket(zmq.DEALER)
        bad.connect(pub.replay_endpoint)
        bad.send_multipart((b"", b"\x00\x01"))  # not 8 bytes
        assert not bad.poll(200)
        bad.close(linger=0)
        assert [seq for _, seq, _ in request_replay(ctx, pub.replay_endpoint, 0)] == [0]


def test_block_hashes_are_published_as_vllm_does() -> None:
    h = bytes(range(1, 17))
    assert external_hash(h, True) == int.from_bytes(h[8:], "big")  # the low 64 bits
    assert external_hash(h, False) == h
    stored = BlockStored(block_hashes=(h, 7), parent_block_hash=h[::-1], token_ids=(1, 2),
                         block_size=2)
    out = to_external(stored, True)
    assert isinstance(out, BlockStored)
    assert out.block_hashes == (int.from_bytes(h[8:], "big"), 7)
    assert out.parent_block_hash == int.from_bytes(h[::-1][8:], "big")
    assert to_external(stored, False) is stored
    removed = to_external(BlockRemoved(block_hashes=(h,)), True)
    assert isinstance(removed, BlockRemoved) and removed.block_hashes == (external_hash(h, True),)


# vLLM's events before tagged maps: positional arrays, with only the fields of that era.
class OldEvent(msgspec.Struct, array_like=True, omit_defaults=True, tag=True):
    pass

class OldBlockStored(OldEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None

class OldBlockRemoved(OldEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None

class OldCleared(OldEvent, tag="AllBlocksCleared"):
    pass

class OldBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[OldBlockStored | OldBlockRemoved | OldCleared]
    data_parallel_rank: int | None = None


def test_the_positional_encoding_decodes_as_arrays(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    """``encoding="array"``: vLLM's encoding before tagged maps, read here with array-like
    structs holding only the fields of that era (later fields are trailing extras)."""

    batches = manager_batches()
    with ZmqEventPublisher(LOCAL, LOCAL, encoding="array") as pub:
        assert pub.replay_endpoint is not None
        for batch in batches:
            pub.publish(batch, ts=2.0)
        wait_until_published(pub, len(batches))
        payloads = [p for _, _, p in request_replay(ctx, pub.replay_endpoint, 0)]
    for payload, sent in zip(payloads, batches, strict=True):
        old = msgspec.msgpack.decode(payload, type=OldBatch)
        assert old.ts == 2.0 and old.data_parallel_rank == 0
        assert [type(e).__name__ for e in old.events] == [
            f"Old{'Cleared' if isinstance(e, AllBlocksCleared) else type(e).__name__}"
            for e in sent]
        for got, event in zip(old.events, sent, strict=True):
            if isinstance(event, (BlockStored, BlockRemoved)):
                assert isinstance(got, (OldBlockStored, OldBlockRemoved))
                assert got.block_hashes == [external_hash(h, True) for h in event.block_hashes
                                            if isinstance(h, bytes)]
                assert got.medium == "GPU"


def test_publish_never_blocks_a_full_queue_drops_and_counts(
        monkeypatch: pytest.MonkeyPatch) -> None:
    release = threading.Event()
    entered = threading.Event()
    original = ZmqEventPublisher._encode

    def slow_encode(self: ZmqEventPublisher, *args: object) -> bytes:
        entered.set()
        release.wait(10)
        return original(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(ZmqEventPublisher, "_encode", slow_encode)
    pub = ZmqEventPublisher(LOCAL, max_queue_size=1)
    try:
        assert pub.publish([AllBlocksCleared()])  # the sender takes it and stalls
        assert entered.wait(5)
        assert pub.publish([AllBlocksCleared()])  # fills the queue
        assert not pub.publish([AllBlocksCleared()])  # dropped, not waited for
        assert pub.num_dropped == 1
        assert pub.publish([])  # nothing to send
    finally:
        release.set()
        pub.shutdown()
    assert pub.num_published == 2


def test_shutdown_sends_what_is_queued_then_refuses_more() -> None:
    pub = ZmqEventPublisher(LOCAL)
    for _ in range(50):
        pub.publish([AllBlocksCleared()])
    pub.shutdown()
    assert pub.num_published == 50
    pub.shutdown()  # idempotent
    with pytest.raises(PublisherClosedError):
        pub.publish([AllBlocksCleared()])


def _port(endpoint: str) -> int:
    return int(endpoint.rsplit(":", 1)[1])


def _bindable(port: int) -> bool:
    """Whether a fresh socket can bind ``port`` on loopback now (ZeroMQ closes sockets on its
    own thread: give it a moment)."""
    for _ in range(100):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
                return True
            except OSError:
                threading.Event().wait(0.02)
    return False


@pytest.fixture
def stalled(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[threading.Event, threading.Event]]:
    """Publishers whose sender stalls in its first batch until ``release`` is set (``entered``
    says it got there)."""
    entered, release = threading.Event(), threading.Event()
    original = ZmqEventPublisher._encode

    def slow_encode(self: ZmqEventPublisher, *args: object) -> bytes:
        entered.set()
        release.wait(10)
        return original(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(ZmqEventPublisher, "_encode", slow_encode)
    yield entered, release
    release.set()


def test_shutdown_without_time_still_closes_the_sockets(
        stalled: tuple[threading.Event, threading.Event]) -> None:
    entered, release = stalled
    pub = ZmqEventPublisher(LOCAL, LOCAL)
    assert pub.replay_endpoint is not None
    ports = [_port(pub.endpoint), _port(pub.replay_endpoint)]
    assert pub.publish([AllBlocksCleared()]) and entered.wait(5)
    threading.Timer(0.2, release.set).start()  # the batch being sent ends a little later
    pub.shutdown(timeout=0)
    assert all(_bindable(port) for port in ports)  # both addresses are free again
    assert not pub._thread.is_alive()


def test_shutdown_counts_and_reports_the_batches_it_drops(
        stalled: tuple[threading.Event, threading.Event],
        caplog: pytest.LogCaptureFixture) -> None:
    entered, release = stalled
    pub = ZmqEventPublisher(LOCAL)
    assert pub.publish([AllBlocksCleared()]) and entered.wait(5)  # being sent
    for _ in range(3):
        assert pub.publish([AllBlocksCleared()])  # queued behind it
    threading.Timer(0.2, release.set).start()
    with caplog.at_level("WARNING", logger="kvcore.events.publisher"):
        pub.shutdown(timeout=0)
    assert [r.getMessage() for r in caplog.records] == [
        "kvcore publisher: 3 queued batches not sent within 0.0s: dropped"]
    assert (pub.num_published, pub.num_dropped) == (1, 3)  # nothing unaccounted for


def test_the_default_endpoint_binds_loopback_and_a_named_one_is_honoured(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import kvcore.events.publisher as publisher

    assert publisher.DEFAULT_ENDPOINT == "tcp://127.0.0.1:5557"
    with socket.socket() as s:  # 5557 may be taken on this machine: the same rule, a free port
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    monkeypatch.setattr(publisher, "DEFAULT_ENDPOINT", f"tcp://127.0.0.1:{free}")
    with ZmqEventPublisher() as pub:
        assert (pub.mode, pub.endpoint) == ("bind", f"tcp://127.0.0.1:{free}")
    with ZmqEventPublisher(f"tcp://127.0.0.1:{free}") as pub:  # vLLM's rule: connects
        assert pub.mode == "connect"
    with ZmqEventPublisher(f"tcp://127.0.0.1:{free}", bind=True) as pub:
        assert (pub.mode, pub.endpoint) == ("bind", f"tcp://127.0.0.1:{free}")
    with ZmqEventPublisher("tcp://*:*") as pub:  # asked for: every interface
        assert pub.mode == "bind" and pub.endpoint.startswith("tcp://0.0.0.0:")


@pytest.mark.parametrize(("kwargs", "words"), [
    ({"endpoint": "localhost:5557"}, ("endpoint", "localhost:5557")),
    ({"endpoint": LOCAL, "replay_endpoint": 5}, ("replay_endpoint", "5")),
    ({"endpoint": LOCAL, "buffer_steps": 0}, ("buffer_steps", "0")),
    ({"endpoint": LOCAL, "hwm": -1}, ("hwm", "-1")),
    ({"endpoint": LOCAL, "max_queue_size": True}, ("max_queue_size", "True")),
    ({"endpoint": LOCAL, "topic": b"kv"}, ("topic",)),
    ({"endpoint": LOCAL, "int_block_hashes": 1}, ("int_block_hashes",)),
    ({"endpoint": LOCAL, "encoding": "json"}, ("encoding", "json")),
    ({"endpoint": LOCAL, "bind": "yes"}, ("bind", "'yes'")),
    ({"endpoint": "tcp://127.0.0.1:notaport"}, ("endpoint", "notaport")),
    ({"endpoint": "tcp://*:notaport"}, ("endpoint", "notaport")),
    ({"endpoint": "tcp://*:99999"}, ("endpoint", "99999")),  # would wrap to another port
    ({"endpoint": "tcp://*:0"}, ("endpoint", "tcp://*:0")),
    ({"endpoint": ""}, ("endpoint", "''")),
    ({"endpoint": "tcp://"}, ("endpoint", "tcp://")),
    ({"endpoint": "udp://*:5557"}, ("endpoint", "udp://")),
    ({"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5557"}, ("replay_endpoint",)),
    ({"endpoint": "tcp://127.0.0.1:5557", "replay_endpoint": "tcp://*:5557"},
     ("replay_endpoint", "PUB")),
    ({"endpoint": "ipc:///tmp/kv", "replay_endpoint": "ipc:///tmp/kv"}, ("replay_endpoint",)),
])
def test_bad_configuration_is_refused_naming_the_value(kwargs: dict[str, object],
                                                       words: tuple[str, ...]) -> None:
    with pytest.raises(InvalidArgumentError) as excinfo:
        ZmqEventPublisher(**kwargs)  # type: ignore[arg-type]
    for word in words:
        assert word in str(excinfo.value)


def test_an_endpoint_in_use_is_refused_and_nothing_leaks() -> None:
    with ZmqEventPublisher(LOCAL, LOCAL) as first:
        assert first.replay_endpoint is not None
        threads = threading.active_count()
        for _ in range(3):  # the replay socket always binds: its address is taken
            with pytest.raises(InvalidArgumentError, match="cannot bind"):
                ZmqEventPublisher(LOCAL, first.replay_endpoint)
        assert threading.active_count() == threads  # no sender thread was started


def test_replay_feeds_an_event_sink_every_step() -> None:
    trace = shared_prefix(num_groups=3, prompts_per_group=4, system_len=64, question_len=16,
                          output_len=4, interval_ms=5.0)
    seen: list[list[KVCacheEvent]] = []
    cfg = ReplayConfig(block_size=16, num_blocks=24, max_num_seqs=4)
    with_sink = replay(trace, cfg, event_sink=seen.append)
    assert with_sink.token_hit_rate == replay(trace, cfg).token_hit_rate  # events change nothing
    events = [e for batch in seen for e in batch]
    stored = sum(len(e.block_hashes) for e in events if isinstance(e, BlockStored))
    removed = sum(len(e.block_hashes) for e in events if isinstance(e, BlockRemoved))
    assert stored > 0 and removed == with_sink.evicted_blocks


def test_cli_replay_publishes(capsys: pytest.CaptureFixture[str]) -> None:
    from kvcore.cli import main

    rc = main(["replay", "--workload", "shared-prefix", "--num-blocks", "400", "--limit", "20",
               "--publish", LOCAL, "--publish-replay", LOCAL, "--json", "--no-progress"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["replay"]["num_finished"] == 20
    assert out["published"]["batches"] > 0 and out["published"]["dropped"] == 0
    assert out["published"]["endpoint"].startswith("tcp://127.0.0.1:")
    assert main(["replay", "--publish-replay", LOCAL]) == 2
    assert "--publish-replay needs --publish" in capsys.readouterr().err
    assert main(["replay", "--publish", ""]) == 2  # not silently ignored
    assert "endpoint" in capsys.readouterr().err



def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _replay_publishing(capsys: pytest.CaptureFixture[str], endpoint: str,
                       *extra: str) -> tuple[int, str, str]:
    from kvcore.cli import main

    rc = main(["replay", "--workload", "shared-prefix", "--num-blocks", "400", "--limit", "20",
               "--no-progress", "--publish", endpoint, *extra])
    out, err = capsys.readouterr()
    return rc, out, err


def test_publish_says_bind_or_connect_and_warns_when_a_connecting_one_had_no_peer(
        ctx: zmq.Context[zmq.Socket[bytes]], capsys: pytest.CaptureFixture[str]) -> None:
    # A subscriber that binds: the connecting publisher reaches it.
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.bind("tcp://127.0.0.1:*")
    last = sub.getsockopt(zmq.LAST_ENDPOINT)
    assert isinstance(last, bytes)
    endpoint = last.decode()
    rc, out, err = _replay_publishing(capsys, endpoint, "--json")
    assert rc == 0, err
    pub = json.loads(out)["published"]
    assert (pub["mode"], pub["peer_connected"]) == ("connect", True) and pub["batches"] > 0
    assert f"publishing KV events: connected to {endpoint} (a subscriber must bind it)" in err
    assert "warning" not in err

    # A subscriber that connects too: nothing can be delivered, and the replay says so.
    lost = f"tcp://127.0.0.1:{_free_port()}"
    other = ctx.socket(zmq.SUB)
    other.connect(lost)
    rc, out, err = _replay_publishing(capsys, lost)
    assert rc == 0, err
    assert f"batches published, connected to {lost} (no peer reached)" in out
    warning = [line for line in err.splitlines() if "warning" in line]
    assert len(warning) == 1 and f"connected to {lost} but no peer ever accepted" in warning[0]
    assert "none of the" in warning[0] and "tcp://*:PORT" in warning[0]
    rc, out, err = _replay_publishing(capsys, lost, "--json")
    pub = json.loads(out)["published"]
    assert (pub["mode"], pub["peer_connected"]) == ("connect", False) and "warning" in err

    # A wildcard port binds: subscribers connect to it, and no peer is not a warning.
    rc, out, err = _replay_publishing(capsys, LOCAL)
    assert rc == 0 and "batches published, bound tcp://127.0.0.1:" in out
    assert "(subscribers connect to it)" in err and "warning" not in err


def test_publish_help_says_which_addresses_bind_and_which_connect(
        capsys: pytest.CaptureFixture[str]) -> None:
    from kvcore.cli import main

    with pytest.raises(SystemExit):
        main(["replay", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "a wildcard host (tcp://*:5557), ipc:// and inproc:// bind" in text
    assert "any other address (tcp://127.0.0.1:5557) connects, so a subscriber must bind it" in text
