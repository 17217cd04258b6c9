"""Publish KV-cache events over ZeroMQ with vLLM's wire behaviour.

A :class:`ZmqEventPublisher` sends each batch of events (what ``KVCacheManager.take_events``
returns after a step) on a PUB socket as the three frames vLLM's ``ZmqEventPublisher`` sends:
``(topic, sequence number as 8 bytes big-endian, msgpack KVEventBatch)``.  KV-aware routers that
subscribe to vLLM (llm-d's indexer, Dynamo's router, SGLang's gateway) read kvcore's stream
unchanged.

* A background thread encodes and sends, so ``publish`` never waits on the network: it only
  queues the batch.  When ``max_queue_size`` batches are already waiting the batch is dropped and
  counted (``num_dropped``) rather than blocking the caller.
* The last ``buffer_steps`` sent batches are kept for replay.  With ``replay_endpoint`` a ROUTER
  socket answers a client that sends a start sequence number (8 bytes big-endian, after the empty
  delimiter frame a REQ or DEALER socket adds) with every buffered batch from there on, each as
  ``(topic, seq, payload)``, then the end marker ``(b"", -1 as 8 signed bytes, b"")``.  A
  subscriber that joins late, or notices a gap in the sequence numbers, recovers that way.
* Block hashes are published as vLLM does by default: the low 64 bits of kvcore's hash bytes
  (big-endian) as an int (``int_block_hashes=False`` keeps the bytes).
* ``encoding="array"`` sends events as positional arrays (``[tag, field, ...]``), the encoding
  vLLM used before tagged maps; the default ``"map"`` is vLLM 0.32's.
* ``shutdown`` sends what is queued (up to ``timeout``), then closes the sockets, always: what
  is still queued when the time is up is dropped and counted (``num_dropped``).
* Bind or connect, as vLLM decides: a wildcard host (``tcp://*:5557``), ``ipc://`` and
  ``inproc://`` bind (subscribers connect to the publisher); any other address connects (a
  subscriber must bind it); ``bind=True``/``False`` decides instead.  ``mode`` says which;
  ``peer_connected`` says whether a peer was ever there (a subscriber accepted on a bound socket,
  the bound peer reached by a connecting one), so a connecting publisher whose peer also
  connects, and thus delivers nothing, can be told apart.
* Without an endpoint, the PUB socket binds :data:`DEFAULT_ENDPOINT`, on loopback: only this
  machine can subscribe.  An endpoint the caller names is used as named (``tcp://*:5557`` listens
  on every interface, as vLLM's default does).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

from kvcore.errors import InvalidArgumentError, KVCoreError
from kvcore.events import BlockRemoved, BlockStored, KVCacheEvent, encode_event_batch

logger = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
"""The replay socket's end-of-replay sequence frame."""

ENCODINGS = ("map", "array")
DEFAULT_ENDPOINT = "tcp://127.0.0.1:5557"
"""Where the PUB socket binds when no endpoint is given (vLLM's port, on loopback only)."""
PEER_WAIT_MS = 500
"""How long ``shutdown`` waits for a connecting publisher's first peer, if none came yet."""


class PublisherClosedError(KVCoreError, RuntimeError):
    """``publish`` after ``shutdown``."""


def external_hash(h: bytes, int_block_hashes: bool) -> bytes | int:
    """A block hash as published: the low 64 bits of its big-endian value (vLLM's default,
    ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``) or the bytes unchanged."""
    return int.from_bytes(h, "big") & 0xFFFF_FFFF_FFFF_FFFF if int_block_hashes else h


def to_external(event: KVCacheEvent, int_block_hashes: bool) -> KVCacheEvent:
    """``event`` with its block hashes (and parent hash) as :func:`external_hash` gives them."""
    if not int_block_hashes:
        return event
    if isinstance(event, BlockStored):
        parent = event.parent_block_hash
        return msgspec.structs.replace(
            event, block_hashes=tuple(external_hash(h, True) if isinstance(h, bytes) else h
                                      for h in event.block_hashes),
            parent_block_hash=external_hash(parent, True) if isinstance(parent, bytes)
            else parent)
    if isinstance(event, BlockRemoved):
        return msgspec.structs.replace(event, block_hashes=tuple(
            external_hash(h, True) if isinstance(h, bytes) else h for h in event.block_hashes))
    return event


def as_array(event: KVCacheEvent) -> list[Any]:
    """``event`` in the positional encoding: ``[tag, field, ...]`` in declaration order, trailing
    fields that the map encoding omits (defaults) left out, as msgspec's ``array_like`` does."""
    info = msgspec.inspect.type_info(type(event))
    assert isinstance(info, msgspec.inspect.StructType)
    present = msgspec.to_builtins(event, builtin_types=(bytes,))  # the map encoding's keys
    values: list[Any] = [info.tag]
    last = 0
    for i, field in enumerate(info.fields, start=1):
        values.append(getattr(event, field.name))
        if field.encode_name in present:
            last = i
    return values[:last + 1]


def encode_payload(events: Sequence[KVCacheEvent], ts: float, *, int_block_hashes: bool = True,
                   encoding: str = "map", data_parallel_rank: int | None = 0) -> bytes:
    """One published batch's bytes (the third frame): ``events`` with their hashes as
    :func:`external_hash` gives them, as tagged maps (``"map"``) or positional arrays."""
    external = [to_external(e, int_block_hashes) for e in events]
    if encoding == "map":
        return encode_event_batch(external, ts, data_parallel_rank)
    return msgspec.msgpack.encode([ts, [as_array(e) for e in external], data_parallel_rank])


def _ms_left(deadline: float) -> int:
    return max(0, int((deadline - time.monotonic()) * 1000))


def _check_int(name: str, value: object, minimum: int) -> int:
    if type(value) is not int or value < minimum:
        raise InvalidArgumentError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def check_endpoint(name: str, value: object) -> str:
    """``value`` as a ZeroMQ endpoint: ``tcp://host:port`` (port 1-65535 or ``*``),
    ``ipc://path`` or ``inproc://name``."""
    ok = False
    if isinstance(value, str):
        scheme, sep, address = value.partition("://")
        ok = bool(sep and address) and scheme in ("tcp", "ipc", "inproc")
        if ok and scheme == "tcp":
            host, colon, port = address.rpartition(":")
            ok = bool(colon and host) and (port == "*" or (port.isdigit()
                                                            and 0 < int(port) < 65536))
        if ok:
            return value
    raise InvalidArgumentError(
        f"{name} must be a ZeroMQ endpoint such as 'tcp://*:5557' (port 1-65535 or *), "
        f"'ipc://path' or 'inproc://name', got {value!r}")


def _same_address(a: str, b: str) -> bool:
    """Whether two endpoints name the same address (a wildcard host overlaps any host of the
    same port; wildcard ports never clash)."""
    if a.startswith("tcp://") and b.startswith("tcp://"):
        host_a, _, port_a = a[6:].rpartition(":")
        host_b, _, port_b = b[6:].rpartition(":")
        return port_a == port_b != "*" and (host_a == host_b or "*" in (host_a, host_b))
    return a == b


def _binds(endpoint: str) -> bool:
    """Bind wildcard, ipc and inproc endpoints; connect to the others (vLLM's rule)."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ZmqEventPublisher:
    """PUB socket + replay ROUTER socket + background sender (see the module docstring).

    Args:
        endpoint: PUB address; ``tcp://*:5557`` binds, ``tcp://host:5557`` connects (``mode``).
            A bound wildcard port (``tcp://127.0.0.1:*``) resolves to the port chosen:
            ``endpoint``.  ``None``: bind :data:`DEFAULT_ENDPOINT` (loopback).
        replay_endpoint: ROUTER address for replay requests (always bound), or ``None``.
        bind: bind (``True``) or connect (``False``) ``endpoint``, whatever its form; ``None``
            decides as vLLM does (see the module docstring).
        buffer_steps: batches kept for replay.
        hwm: the PUB socket's send high-water mark (ZeroMQ drops beyond it, per subscriber).
        max_queue_size: batches waiting for the sender before ``publish`` drops them.
        topic: the first frame of every message.
        data_parallel_rank: the batch's rank field.
        int_block_hashes: publish hashes as 64-bit ints (vLLM's default) or as bytes.
        encoding: ``"map"`` (tagged maps, vLLM 0.32) or ``"array"`` (positional arrays).
    """

    def __init__(self, endpoint: str | None = None, replay_endpoint: str | None = None, *,
                 bind: bool | None = None, buffer_steps: int = 10_000, hwm: int = 100_000,
                 max_queue_size: int = 100_000, topic: str = "", data_parallel_rank: int = 0,
                 int_block_hashes: bool = True, encoding: str = "map") -> None:
        if bind is not None and not isinstance(bind, bool):
            raise InvalidArgumentError(f"bind must be a bool or None, got {bind!r}")
        if endpoint is None:
            endpoint, bind = DEFAULT_ENDPOINT, True if bind is None else bind
        endpoint = check_endpoint("endpoint", endpoint)
        if replay_endpoint is not None:
            replay_endpoint = check_endpoint("replay_endpoint", replay_endpoint)
            if _same_address(endpoint, replay_endpoint):
                raise InvalidArgumentError(f"replay_endpoint {replay_endpoint!r} is the PUB "
                                           f"endpoint's address ({endpoint!r})")
        self.buffer_steps = _check_int("buffer_steps", buffer_steps, 1)
        hwm = _check_int("hwm", hwm, 0)
        max_queue_size = _check_int("max_queue_size", max_queue_size, 1)
        self.data_parallel_rank = _check_int("data_parallel_rank", data_parallel_rank, 0)
        if not isinstance(topic, str):
            raise InvalidArgumentError(f"topic must be a str, got {topic!r}")
        if not isinstance(int_block_hashes, bool):
            raise InvalidArgumentError(f"int_block_hashes must be a bool, got {int_block_hashes!r}")
        if encoding not in ENCODINGS:
            raise InvalidArgumentError(f"encoding must be one of {ENCODINGS}, got {encoding!r}")
        self.topic = topic
        self.int_block_hashes = int_block_hashes
        self.encoding = encoding
        self.num_published = 0
        self.num_dropped = 0
        self._queue: queue.Queue[tuple[float, list[KVCacheEvent]]] = queue.Queue(max_queue_size)
        self._stopping = threading.Event()  # the sender ends once the queue is empty
        self._abandon = threading.Event()  # the sender ends before its next batch
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=self.buffer_steps)
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self.mode = "bind" if (_binds(endpoint) if bind is None else bind) else "connect"
        self.peer_connected = False  # set from the socket's monitor (see _watch_peers)
        self._pub = self._ctx.socket(zmq.PUB)
        self._replay: zmq.Socket[bytes] | None = None
        self._monitor: zmq.Socket[bytes] | None = None
        try:
            self._pub.set_hwm(hwm)
            # Before bind/connect, so that no connection goes unseen.
            self._monitor = self._pub.get_monitor_socket(
                zmq.EVENT_CONNECTED if self.mode == "connect" else zmq.EVENT_ACCEPTED)
            self.endpoint = self._open(self._pub, endpoint, bind=self.mode == "bind")
            if replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self.replay_endpoint: str | None = self._open(self._replay, replay_endpoint,
                                                              bind=True)
            else:
                self.replay_endpoint = None
        except BaseException:
            self._close_sockets()
            raise
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kvcore-zmq-publisher",
                                        daemon=True)
        self._thread.start()

    @staticmethod
    def _open(sock: zmq.Socket[bytes], endpoint: str, bind: bool) -> str:
        try:
            if not bind:
                sock.connect(endpoint)
                return endpoint
            sock.bind(endpoint)
        except zmq.ZMQError as exc:
            raise InvalidArgumentError(
                f"cannot {'bind' if bind else 'connect'} {endpoint!r}: {exc}") from exc
        last = sock.getsockopt(zmq.LAST_ENDPOINT)
        return last.decode() if isinstance(last, bytes) and last else endpoint

    # -- the caller's side ----------------------------------------------------------------------
    def publish(self, events: Sequence[KVCacheEvent], ts: float | None = None) -> bool:
        """Queue one batch (``ts`` defaults to now); an empty batch is not sent.  Returns whether
        it was queued (``False``: the queue was full and the batch was dropped and counted)."""
        if self._closed:
            raise PublisherClosedError("publish after shutdown")
        if not events:
            return True
        try:
            self._queue.put_nowait((time.time() if ts is None else ts, list(events)))
        except queue.Full:
            self.num_dropped += 1
            return False
        return True

    def shutdown(self, timeout: float = 5.0) -> None:
        """Send what is queued for at most ``timeout`` seconds, stop the thread and close the
        sockets, whatever the timeout (0 included).  Batches still queued when the time is up
        are dropped, counted in ``num_dropped`` and logged; the batch the sender is handing to
        ZeroMQ then is finished first.  Idempotent."""
        if self._closed:
            return
        self._closed = True
        deadline = time.monotonic() + max(timeout, 0.0)
        self._stopping.set()
        self._thread.join(max(timeout, 0.0))
        if self._thread.is_alive():
            self._abandon.set()
            self._thread.join()  # at most the batch being sent
        left = self._queue.qsize()  # the sender has stopped: exact
        if left:
            self.num_dropped += left
            logger.warning("kvcore publisher: %d queued batches not sent within %.1fs: dropped",
                           left, timeout)
        # The monitor is this thread's now.  A connection may still be on its way (a short
        # run): wait for it a little, within the timeout.
        if self.mode == "connect" and not self.peer_connected:
            self._watch_peers(wait_ms=min(PEER_WAIT_MS, _ms_left(deadline)))
        # What the sender handed to ZeroMQ may still be on its way (a connecting PUB socket's
        # peer may not even be reached yet): give it the rest of the timeout.
        self._close_sockets(linger_ms=_ms_left(deadline))

    def __enter__(self) -> ZmqEventPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def describe(self) -> str:
        """What was done with ``endpoint``, for people: ``bound tcp://…`` or ``connected to
        tcp://…``, and who must do the other half."""
        if self.mode == "bind":
            return f"bound {self.endpoint} (subscribers connect to it)"
        return f"connected to {self.endpoint} (a subscriber must bind it)"

    def undelivered_warning(self) -> str | None:
        """After ``shutdown``: why nothing can have been delivered, when a connecting publisher
        never reached a peer (e.g. a subscriber that connects too); else ``None``."""
        if self.mode != "connect" or self.peer_connected:
            return None
        return (f"the publisher connected to {self.endpoint} but no peer ever accepted the "
                f"connection: none of the {self.num_published:,} batches was delivered (a "
                "subscriber must bind that address; or publish on tcp://*:PORT, which binds)")

    def _watch_peers(self, wait_ms: int = 0) -> None:
        """Read the monitor's connection events (waiting up to ``wait_ms`` for the first)."""
        monitor = self._monitor
        while monitor is not None and not self.peer_connected and monitor.poll(wait_ms):
            if recv_monitor_message(monitor)["event"] & (zmq.EVENT_CONNECTED
                                                         | zmq.EVENT_ACCEPTED):
                self.peer_connected = True

    def _close_sockets(self, linger_ms: int = 0) -> None:
        if self._monitor is not None:
            self._pub.disable_monitor()
            self._monitor.close(linger=0)
        self._pub.close(linger=linger_ms)
        if self._replay is not None:
            self._replay.close(linger=0)

    # -- the sender thread ----------------------------------------------------------------------
    def _run(self) -> None:
        topic = self.topic.encode()
        seq = 0
        while not self._abandon.is_set():
            if not self.peer_connected:
                self._watch_peers()
            if self._replay is not None and self._replay.poll(0):
                self._serve_replay(topic)
            stopping = self._stopping.is_set()
            try:
                ts, events = self._queue.get_nowait() if stopping else self._queue.get(
                    timeout=0.02)
            except queue.Empty:
                if stopping:  # drained
                    return
                continue
            try:
                payload = self._encode(ts, events)
                self._pub.send_multipart((topic, seq.to_bytes(8, "big"), payload))
            except Exception:  # never let one bad batch stop the stream
                logger.exception("kvcore publisher: batch %d not sent", seq)
                continue
            self._buffer.append((seq, payload))
            self.num_published += 1
            seq += 1

    def _encode(self, ts: float, events: list[KVCacheEvent]) -> bytes:
        return encode_payload(events, ts, int_block_hashes=self.int_block_hashes,
                              encoding=self.encoding, data_parallel_rank=self.data_parallel_rank)

    def _serve_replay(self, topic: bytes) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            logger.warning("kvcore publisher: malformed replay request (%d frames)", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big", signed=True)
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart((client, b"", topic, seq.to_bytes(8, "big"),
                                             payload))
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))
