"""Replicas' real ZeroMQ publishers feeding a Dynamo indexer, and a barrier that says when the
indexer has applied everything published so far.

The indexer reads each stream asynchronously, so a router that queries it right after a
replica's step may see an older state.  :meth:`DynamoFeed.barrier` makes the replay
deterministic: it publishes, on each replica's stream after its real events, one *marker*
block — a ``BlockStored`` of one block of tokens no prompt contains (ids from ``0xC0000000``
up, a generation number in the first) under a 64-bit hash of its own — and polls ``/query``
with the marker's tokens until every such replica holds it.  A stream is applied in order, so
by then every earlier batch of that replica is in the indexer.  The replica's previous marker
is removed in the same batch, so each replica holds one marker block, alone under the root,
that no real prompt ever reaches.  Cost: one extra batch per replica that published since the
last barrier, and one or more ``/query`` round trips, per barrier.

The first barrier also covers ZeroMQ's slow joiner: a marker published before the indexer's
subscription reaches the PUB socket is dropped, so a missing marker is published again (every
``republish_s``) until it arrives; the indexer then sees a sequence gap and fetches the batches
it missed from the replica's replay socket.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

import xxhash

from kvcore.cluster.dynamo.indexer import DynamoIndexer, DynamoIndexerError
from kvcore.errors import InvalidArgumentError
from kvcore.events import BlockRemoved, BlockStored, KVCacheEvent
from kvcore.events.publisher import ZmqEventPublisher

MARKER_TOKEN = 0xFFFF_FFFF
MARKER_GENERATION = 0xC000_0000
HOST_ENDPOINT = "tcp://127.0.0.1:*"


def marker_tokens(generation: int, block_size: int) -> list[int]:
    """One block of tokens no prompt contains: the generation in the first, then fill."""
    return [MARKER_GENERATION | (generation & 0x3FFF_FFFF)] + [MARKER_TOKEN] * (block_size - 1)


def marker_hash(generation: int) -> int:
    return xxhash.xxh3_64_intdigest(b"kvcore-dynamo-barrier:%d" % generation)


class DynamoFeed:
    """Replicas' publishers registered with ``indexer``, replica ``i`` as worker ``i``; see the
    module docstring.  :meth:`open` makes the publishers (PUB + replay ROUTER on 127.0.0.1,
    ports chosen by the OS); the constructor takes publishers that may have published already
    (the indexer then joins late and recovers through their replay sockets).

    Args:
        indexer: a started :class:`DynamoIndexer`.
        publishers: one per replica; the feed shuts them down on :meth:`close`.
        block_size: the block size of the replicas' events (the indexer hashes by it).
        barrier_timeout_s: how long a barrier may wait before it raises.
        republish_s: how often a barrier sends a marker again that has not arrived.
    """

    def __init__(self, indexer: DynamoIndexer, publishers: Sequence[ZmqEventPublisher],
                 block_size: int, *, barrier_timeout_s: float = 60.0,
                 republish_s: float = 0.25) -> None:
        self.publishers = list(publishers)
        try:
            if not self.publishers:
                raise InvalidArgumentError("a DynamoFeed needs at least one publisher")
            if type(block_size) is not int or block_size < 1:
                raise InvalidArgumentError(
                    f"block_size must be a positive int, got {block_size!r}")
            self.indexer = indexer
            self.block_size = block_size
            self.barrier_timeout_s = barrier_timeout_s
            self.republish_s = republish_s
            self.num_barriers = 0
            self.num_polls = 0
            self.barrier_s = 0.0  # time spent in barriers
            self._generation = 0
            self._marker: list[int | None] = [None] * len(self.publishers)  # marker hashes
            self._dirty = set(range(len(self.publishers)))  # published since their barrier
            for replica, pub in enumerate(self.publishers):
                indexer.register(replica, pub.endpoint, pub.replay_endpoint, block_size)
        except BaseException:
            self.close()
            raise

    @classmethod
    def open(cls, indexer: DynamoIndexer, num_replicas: int, block_size: int, *,
             encoding: str | Sequence[str] = "map", **kwargs: float) -> DynamoFeed:
        """New publishers for ``num_replicas`` replicas, with ``encoding`` (``"map"`` or
        ``"array"``, or one per replica), registered with ``indexer``."""
        if type(num_replicas) is not int or num_replicas < 1:
            raise InvalidArgumentError(
                f"num_replicas must be a positive int, got {num_replicas!r}")
        encodings = [encoding] * num_replicas if isinstance(encoding, str) else list(encoding)
        if len(encodings) != num_replicas:
            raise InvalidArgumentError(f"{len(encodings)} encodings for {num_replicas} replicas")
        publishers: list[ZmqEventPublisher] = []
        try:
            for enc in encodings:
                publishers.append(ZmqEventPublisher(HOST_ENDPOINT, HOST_ENDPOINT, encoding=enc))
        except BaseException:
            for pub in publishers:
                pub.shutdown(timeout=0)
            raise
        return cls(indexer, publishers, block_size, **kwargs)

    def publish(self, replica: int, events: Sequence[KVCacheEvent], ts: float = 0.0) -> None:
        """Send one batch of ``replica``'s events (an empty batch is not sent)."""
        if events:
            self.publishers[replica].publish(events, ts)
            self._dirty.add(replica)

    def barrier(self, replicas: Iterable[int] | None = None) -> None:
        """Return once the indexer has applied every batch published so far by ``replicas``
        (default: those that published since their last barrier)."""
        todo = sorted(self._dirty if replicas is None else set(replicas))
        if not todo:
            return
        t0 = time.perf_counter()
        self._generation += 1
        gen = self._generation
        tokens = marker_tokens(gen, self.block_size)
        key = marker_hash(gen)
        stored = BlockStored(block_hashes=(key,), parent_block_hash=None,
                             token_ids=tuple(tokens), block_size=self.block_size)
        for replica in todo:
            previous = self._marker[replica]
            batch: list[KVCacheEvent] = [stored]
            if previous is not None:
                batch.insert(0, BlockRemoved(block_hashes=(previous,)))
            self.publishers[replica].publish(batch)
            self._marker[replica] = key
        waiting = set(todo)
        deadline = t0 + self.barrier_timeout_s
        republish_at = t0 + self.republish_s
        pause = 0.0001
        while True:
            self.num_polls += 1
            waiting -= self.indexer.query(tokens).keys()
            if not waiting:
                break
            now = time.perf_counter()
            if now > deadline:
                raise DynamoIndexerError(
                    f"the indexer did not apply replicas {sorted(waiting)}'s events within "
                    f"{self.barrier_timeout_s:.0f}s (barrier {gen}): {self.indexer.output()}")
            if now > republish_at:  # lost before the subscription arrived: send it again
                for replica in waiting:
                    self.publishers[replica].publish([stored])
                republish_at = now + self.republish_s
            time.sleep(pause)
            pause = min(pause * 2, 0.005)
        self._dirty.difference_update(todo)
        self.num_barriers += 1
        self.barrier_s += time.perf_counter() - t0

    def close(self) -> None:
        """Shut the publishers down (what is queued is sent first); idempotent."""
        for pub in self.publishers:
            pub.shutdown(timeout=1.0)

    def __enter__(self) -> DynamoFeed:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
