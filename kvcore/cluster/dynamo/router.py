"""Route with Dynamo's KV indexer, and count where it disagrees with kvcore's own index.

:class:`DynamoRouter` is the ``prefix`` router's cost (``load_weight × pending tokens + prompt
tokens to compute``) with the cached prefix as Dynamo's indexer reports it: before each
decision it waits for the indexer to apply every event published so far
(:meth:`DynamoFeed.barrier`), then asks ``/query`` with the prompt's tokens (the full blocks a
hit can serve, as :func:`~kvcore.cluster.index.request_keys` cuts them).  On every decision it
also asks kvcore's :class:`~kvcore.cluster.index.KVRoutingIndex` (fed the same events in
process) and :class:`~kvcore.cluster.dynamo.semantics.DynamoSemantics`, and counts in
:class:`Disagreements` where the answers differ, by cause, and whether kvcore's index would have
sent the request elsewhere.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from kvcore.cluster.dynamo.feed import DynamoFeed
from kvcore.cluster.dynamo.semantics import DynamoSemantics
from kvcore.cluster.index import KVRoutingIndex
from kvcore.cluster.router import (
    ReplicaLoad,
    Router,
    check_block_size,
    check_load_weight,
    lowest_cost,
)
from kvcore.errors import InvalidArgumentError
from kvcore.events import ExternalBlockHash, KVCacheEvent
from kvcore.events.publisher import to_external

UNEXPLAINED = "unexplained"


@dataclass
class Disagreements:
    """Dynamo's answers against kvcore's index, over the routed requests that had a prefix to
    look up.  A *pair* is one (request, replica) whose matched blocks differ."""

    queries: int = 0  # requests whose prefix was looked up in both
    agreed: int = 0  # same matched blocks on every replica
    kvcore_more: int = 0  # pairs where kvcore's index matched more blocks than Dynamo
    dynamo_more: int = 0  # pairs where Dynamo matched more
    # kvcore_more pairs by why Dynamo lacks the first block it missed (semantics.COPIES,
    # GROUP, ORPHAN), or "unexplained"; dynamo_more pairs are always "unexplained".
    by_cause: dict[str, int] = field(default_factory=dict)
    # Requests whose answer from Dynamo differs from DynamoSemantics' prediction.
    unpredicted: int = 0
    # Requests kvcore's index (same cost, its tier-weighted scores) would have routed elsewhere.
    decisions_changed: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class DynamoRouter(Router):
    """See the module docstring.  Feed it every replica's events through :meth:`publish`.

    Args:
        feed: the publishers registered with a running indexer.
        index: kvcore's index, fed the same events elsewhere (e.g. an ``EventChannel``).
        block_size: tokens per block (the events' and the indexer's).
        load_weight: as for the ``prefix`` router.
    """

    name = "dynamo"

    def __init__(self, feed: DynamoFeed, index: KVRoutingIndex, block_size: int,
                 load_weight: float = 1.0) -> None:
        self.feed = feed
        self.index = index
        self.block_size = check_block_size(block_size)
        if block_size != feed.block_size:
            raise InvalidArgumentError(f"block_size {block_size} differs from the feed's "
                                       f"({feed.block_size})")
        self.load_weight = check_load_weight(load_weight)
        self.semantics = DynamoSemantics()
        self.disagreements = Disagreements()

    def publish(self, replica: int, events: list[KVCacheEvent], ts: float = 0.0) -> None:
        """Send ``replica``'s batch to the indexer (and to the semantics model)."""
        self.feed.publish(replica, events, ts)
        # As published: 64-bit int hashes, the keys of request_keys and of the indexer.
        self.semantics.apply_events(replica, (to_external(e, True) for e in events))

    def route(self, keys: Sequence[ExternalBlockHash], num_prompt_tokens: int,
              loads: Sequence[ReplicaLoad], token_ids: Sequence[int] | None = None) -> int:
        bs = self.block_size
        if not keys:
            return lowest_cost({}, num_prompt_tokens, loads, bs, self.load_weight)
        if token_ids is None or len(token_ids) < len(keys) * bs:
            raise InvalidArgumentError(
                f"the dynamo router needs the prompt's token ids ({len(keys) * bs} at least), "
                f"got {None if token_ids is None else len(token_ids)}")
        self.feed.barrier()
        dynamo = {r: tokens // bs for r, tokens in
                  self.feed.indexer.query(token_ids[:len(keys) * bs]).items()}
        kvcore = self.index.match(keys)
        self._compare(keys, dynamo, {r: n for r, (n, _) in kvcore.items()})
        blocks: dict[Hashable, float] = {r: float(n) for r, n in dynamo.items()}
        choice = lowest_cost(blocks, num_prompt_tokens, loads, bs, self.load_weight)
        mine = lowest_cost({r: score for r, (_, score) in kvcore.items()}, num_prompt_tokens,
                           loads, bs, self.load_weight)
        if choice != mine:
            self.disagreements.decisions_changed += 1
        return choice

    def _compare(self, keys: Sequence[ExternalBlockHash], dynamo: dict[int, int],
                 kvcore: dict[Any, int]) -> None:
        d = self.disagreements
        d.queries += 1
        if self.semantics.match(keys) != dynamo:
            d.unpredicted += 1
        if dynamo == kvcore:
            d.agreed += 1
            return
        for replica in dynamo.keys() | kvcore.keys():
            mine, theirs = kvcore.get(replica, 0), dynamo.get(replica, 0)
            if mine > theirs:
                d.kvcore_more += 1
                cause = self.semantics.why_missing(replica, keys[theirs]) or UNEXPLAINED
            elif theirs > mine:
                d.dynamo_more += 1
                cause = UNEXPLAINED
            else:
                continue
            d.by_cause[cause] = d.by_cause.get(cause, 0) + 1
