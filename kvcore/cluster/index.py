"""A KV-aware routing index: which replica caches which block, and in which tier.

The index is built only from KV events, the way llm-d's kv-cache indexer and Dynamo's KV router
build theirs: every replica publishes its event batches (:mod:`kvcore.events.publisher`, or the
in-process :class:`EventChannel`), and :meth:`KVRoutingIndex.apply_payload` decodes each batch
with the same decoder a ZeroMQ subscriber uses.  Blocks are keyed by their published hash
(vLLM's 64-bit ints by default), so a router hashes a request's prompt the same way
(:func:`request_keys`) and asks :meth:`KVRoutingIndex.match` how long a consecutive prefix each
replica holds.

Tiers: a ``BlockStored`` event's ``medium`` says where the block lives (``"GPU"`` for the device
pool, ``"CPU"`` for a host tier).  A block's weight on a replica is the largest weight among the
media holding it there (GPU 1.0, CPU 0.8 by default, as llm-d scores them): a host hit still
costs a copy.  A replica's score is the sum of those weights over the longest run of leading
blocks it holds in any tier.

Copies are counted: a pool may cache equal content twice (append-only block tables), and a
model with several KV-cache groups stores a hash once per group, so a ``BlockRemoved`` for one
copy leaves the block indexed while another copy remains.  Groups are not told apart (a block
counts if any group holds it: an upper bound for hybrid models, as in llm-d).
``AllBlocksCleared`` drops the replica's device (GPU) entries; its host tier is unaffected.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping, Sequence
from typing import TypeAlias

from kvcore.errors import InvalidArgumentError
from kvcore.events import (
    MEDIUM_CPU,
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    ExternalBlockHash,
    KVCacheEvent,
    decode_event_batch,
)
from kvcore.events.publisher import encode_payload, external_hash

DEFAULT_MEDIUM_WEIGHTS: Mapping[str, float] = {MEDIUM_GPU: 1.0, MEDIUM_CPU: 0.8}

ReplicaId: TypeAlias = Hashable


def request_keys(block_hashes: Sequence[bytes], num_prompt_tokens: int, block_size: int,
                 int_block_hashes: bool = True) -> list[ExternalBlockHash]:
    """The published keys of a prompt's blocks that a prefix hit can serve: its full blocks,
    the last prompt token excluded (its logits are always computed)."""
    n = min(len(block_hashes), max(num_prompt_tokens - 1, 0) // block_size)
    return [external_hash(h, int_block_hashes) for h in block_hashes[:n]]


class KVRoutingIndex:
    """Block key → replicas (and tiers) holding it, fed by event batches; see the module doc.

    Args:
        medium_weights: weight of a block by tier (default GPU 1.0, CPU 0.8); a medium not
            listed weighs 1.0.
    """

    def __init__(self, medium_weights: Mapping[str, float] | None = None) -> None:
        weights = dict(DEFAULT_MEDIUM_WEIGHTS if medium_weights is None else medium_weights)
        for medium, w in weights.items():
            if not isinstance(w, (int, float)) or isinstance(w, bool) or not 0 < w <= 1:
                raise InvalidArgumentError(
                    f"medium weight for {medium!r} must be a number in (0, 1], got {w!r}")
        self.medium_weights = weights
        # key -> replica -> medium -> copies
        self._blocks: dict[ExternalBlockHash, dict[ReplicaId, dict[str, int]]] = {}
        self._last_seq: dict[ReplicaId, int] = {}
        self.num_batches = 0
        self.num_events = 0
        self.num_gaps = 0  # batches that did not follow their replica's previous sequence number

    # -- feeding --------------------------------------------------------------------------------
    def apply_payload(self, replica: ReplicaId, payload: bytes, seq: int | None = None) -> None:
        """Decode one published batch (the third frame of a message) from ``replica`` and apply
        it.  ``seq`` (the message's sequence number) is checked against the replica's previous
        one; a gap is counted in ``num_gaps`` (a subscriber then asks the replay socket)."""
        batch = decode_event_batch(payload)  # raises before anything changes
        if seq is not None:
            last = self._last_seq.get(replica)
            if last is not None and seq != last + 1:
                self.num_gaps += 1
            self._last_seq[replica] = seq
        self.apply_events(replica, batch.events)

    def apply_events(self, replica: ReplicaId, events: Iterable[KVCacheEvent]) -> None:
        """Apply decoded events from ``replica``, in order."""
        blocks = self._blocks
        n = 0
        for event in events:
            n += 1
            if isinstance(event, BlockStored):
                medium = event.medium or MEDIUM_GPU
                for key in event.block_hashes:
                    holders = blocks.get(key)
                    if holders is None:
                        blocks[key] = {replica: {medium: 1}}
                        continue
                    media = holders.get(replica)
                    if media is None:
                        holders[replica] = {medium: 1}
                    else:
                        media[medium] = media.get(medium, 0) + 1
            elif isinstance(event, BlockRemoved):
                self._remove(replica, event.block_hashes, event.medium or MEDIUM_GPU)
            elif isinstance(event, AllBlocksCleared):
                self._clear(replica, MEDIUM_GPU)
        self.num_events += n
        self.num_batches += 1

    def _remove(self, replica: ReplicaId, keys: Iterable[ExternalBlockHash], medium: str) -> None:
        blocks = self._blocks
        for key in keys:
            holders = blocks.get(key)
            media = holders.get(replica) if holders is not None else None
            if media is None or medium not in media:
                continue  # an event from before this index started (a late subscriber)
            assert holders is not None
            if media[medium] > 1:
                media[medium] -= 1
                continue
            del media[medium]
            if not media:
                del holders[replica]
                if not holders:
                    del blocks[key]

    def _clear(self, replica: ReplicaId, medium: str | None) -> None:
        for key in list(self._blocks):
            holders = self._blocks[key]
            media = holders.get(replica)
            if media is None:
                continue
            if medium is None:
                media.clear()
            else:
                media.pop(medium, None)
            if not media:
                del holders[replica]
                if not holders:
                    del self._blocks[key]

    def remove_replica(self, replica: ReplicaId) -> None:
        """Forget everything ``replica`` holds (it went away or restarted)."""
        self._clear(replica, None)
        self._last_seq.pop(replica, None)

    # -- queries --------------------------------------------------------------------------------
    def __len__(self) -> int:
        """Distinct block keys held by any replica."""
        return len(self._blocks)

    def holders(self, key: ExternalBlockHash) -> dict[ReplicaId, dict[str, int]]:
        """A copy of who holds ``key``: replica → medium → copies."""
        return {r: dict(m) for r, m in self._blocks.get(key, {}).items()}

    def snapshot(self) -> dict[ExternalBlockHash, dict[ReplicaId, dict[str, int]]]:
        """A deep copy of the whole index: key → replica → medium → copies."""
        return {key: {r: dict(m) for r, m in holders.items()}
                for key, holders in self._blocks.items()}

    def num_blocks(self, replica: ReplicaId, medium: str | None = None) -> int:
        """Keys ``replica`` holds (in ``medium``, or in any tier)."""
        return sum(1 for holders in self._blocks.values()
                   if (m := holders.get(replica)) and (medium is None or medium in m))

    def match(self, keys: Sequence[ExternalBlockHash]) -> dict[ReplicaId, tuple[int, float]]:
        """Per replica holding ``keys[0]``: ``(blocks, score)`` for the longest run of leading
        keys it holds in any tier, ``score`` weighting each block by its best tier.  Replicas
        holding nothing of the prefix are absent.  O(prefix length × replicas)."""
        blocks = self._blocks
        weights = self.medium_weights
        result: dict[ReplicaId, tuple[int, float]] = {}
        alive: dict[ReplicaId, float] = {}  # replicas matching every key so far: their score
        n = 0  # keys matched by every replica in ``alive``
        for key in keys:
            holders = blocks.get(key)
            if holders is None:
                break
            if n == 0:
                scores = {r: max(weights.get(m, 1.0) for m in media)
                          for r, media in holders.items()}
            else:
                scores = {}
                for replica, score in alive.items():
                    media = holders.get(replica)
                    if media:
                        scores[replica] = score + max(weights.get(m, 1.0) for m in media)
                    else:
                        result[replica] = (n, score)
            if not scores:
                break
            alive = scores
            n += 1
        for replica, score in alive.items():
            result[replica] = (n, score)
        return result


class EventChannel:
    """An in-process transport from one replica's manager to an index: each ``publish`` encodes
    the batch exactly as :class:`~kvcore.events.publisher.ZmqEventPublisher` sends it (same sequence
    numbers, same bytes) and hands the payload to :meth:`KVRoutingIndex.apply_payload`.  Use
    it as a replay's ``event_sink`` where the router runs in the same process."""

    def __init__(self, index: KVRoutingIndex, replica: ReplicaId, *,
                 int_block_hashes: bool = True, data_parallel_rank: int | None = 0) -> None:
        self.index = index
        self.replica = replica
        self.int_block_hashes = int_block_hashes
        self.data_parallel_rank = data_parallel_rank
        self.seq = 0
        self.num_bytes = 0

    def publish(self, events: Sequence[KVCacheEvent], ts: float = 0.0) -> bool:
        """Deliver one batch (an empty batch is not sent, as the publisher does)."""
        if not events:
            return True
        payload = encode_payload(events, ts, int_block_hashes=self.int_block_hashes,
                                 data_parallel_rank=self.data_parallel_rank)
        self.index.apply_payload(self.replica, payload, self.seq)
        self.seq += 1
        self.num_bytes += len(payload)
        return True
