"""Routers: pick the replica for a new request.

* ``round-robin``: replicas in turn, blind to load and cache.
* ``least-loaded``: the replica with the fewest pending tokens (prompt tokens queued or being
  prefilled), then the lowest KV-cache usage, then the fewest requests.
* ``prefix``: the replica with the lowest estimated cost to the request's first token, in
  tokens: ``load_weight × pending tokens + prompt tokens it would compute`` — the second term
  is the prompt minus the replica's tier-weighted cached prefix from the
  :class:`~kvcore.cluster.index.KVRoutingIndex` (a GPU hit saves a block's tokens, a host hit
  0.8 of them).  So a hot prefix draws its requests until the queue it builds costs more than
  the hit saves, then spills to the next-best replica.  Ties go to the less loaded replica
  (as ``least-loaded`` orders them).
* ``dynamo``: the same cost, with the cached prefix as NVIDIA Dynamo's KV indexer reports it
  (:class:`kvcore.cluster.dynamo.DynamoRouter`: a separate process fed by ZeroMQ publishers).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

from kvcore.cluster.index import KVRoutingIndex
from kvcore.errors import InvalidArgumentError
from kvcore.events import ExternalBlockHash


@dataclass(frozen=True)
class ReplicaLoad:
    """What a router knows about a replica's queue when a request arrives."""

    num_requests: int  # waiting + running
    pending_tokens: int  # prefill backlog: uncomputed tokens of requests not yet decoding
    usage: float = 0.0  # share of the replica's KV-cache blocks in use


class Router:
    """Base: ``route`` returns the index of the chosen replica in ``loads``.  ``keys`` are the
    published hashes of the prompt's blocks a hit can serve (:func:`request_keys`),
    ``token_ids`` the prompt's tokens (for routers that hash tokens themselves)."""

    name = "router"

    def route(self, keys: Sequence[ExternalBlockHash], num_prompt_tokens: int,
              loads: Sequence[ReplicaLoad], token_ids: Sequence[int] | None = None) -> int:
        raise NotImplementedError


def _load_key(load: ReplicaLoad, i: int) -> tuple[int, float, int, int]:
    return (load.pending_tokens, load.usage, load.num_requests, i)


def _least_loaded(loads: Sequence[ReplicaLoad]) -> int:
    return min(range(len(loads)), key=lambda i: _load_key(loads[i], i))


def lowest_cost(cached_blocks: Mapping[Hashable, float], num_prompt_tokens: int,
                loads: Sequence[ReplicaLoad], block_size: int, load_weight: float) -> int:
    """The replica ``i`` with the lowest ``load_weight × pending tokens + prompt tokens it would
    compute``, where ``cached_blocks[i]`` (absent: 0) is its cached prefix in blocks, weighted
    by tier; ties go to the less loaded replica."""

    def cost(i: int) -> tuple[float, tuple[int, float, int, int]]:
        load = loads[i]
        return (load_weight * load.pending_tokens + num_prompt_tokens
                - cached_blocks.get(i, 0.0) * block_size, _load_key(load, i))

    return min(range(len(loads)), key=cost)


def check_block_size(block_size: object) -> int:
    if type(block_size) is not int or block_size <= 0:
        raise InvalidArgumentError(f"block_size must be a positive int, got {block_size!r}")
    return block_size


def check_load_weight(load_weight: object) -> float:
    if not isinstance(load_weight, (int, float)) or isinstance(load_weight, bool) \
            or not load_weight >= 0:
        raise InvalidArgumentError(f"load_weight must be a number >= 0, got {load_weight!r}")
    return float(load_weight)


class RoundRobinRouter(Router):
    name = "round-robin"

    def __init__(self) -> None:
        self._next = 0

    def route(self, keys: Sequence[ExternalBlockHash], num_prompt_tokens: int,
              loads: Sequence[ReplicaLoad], token_ids: Sequence[int] | None = None) -> int:
        i = self._next % len(loads)
        self._next = i + 1
        return i


class LeastLoadedRouter(Router):
    name = "least-loaded"

    def route(self, keys: Sequence[ExternalBlockHash], num_prompt_tokens: int,
              loads: Sequence[ReplicaLoad], token_ids: Sequence[int] | None = None) -> int:
        return _least_loaded(loads)


class PrefixRouter(Router):
    """Lowest ``load_weight × pending tokens + tokens to compute`` (see the module doc)."""

    name = "prefix"

    def __init__(self, index: KVRoutingIndex, block_size: int, load_weight: float = 1.0) -> None:
        self.index = index
        self.block_size = check_block_size(block_size)
        self.load_weight = check_load_weight(load_weight)

    def route(self, keys: Sequence[ExternalBlockHash], num_prompt_tokens: int,
              loads: Sequence[ReplicaLoad], token_ids: Sequence[int] | None = None) -> int:
        scores = {r: score for r, (_, score) in self.index.match(keys).items()}
        return lowest_cost(scores, num_prompt_tokens, loads, self.block_size, self.load_weight)


ROUTERS = ("prefix", "round-robin", "least-loaded", "dynamo")


def make_router(name: str, index: KVRoutingIndex | None = None, block_size: int = 16,
                load_weight: float = 1.0) -> Router:
    """A router by name (``ROUTERS``); ``prefix`` needs the index; ``dynamo`` needs a running
    indexer and is built by :class:`kvcore.cluster.dynamo.DynamoRouter`."""
    if name == "round-robin":
        return RoundRobinRouter()
    if name == "least-loaded":
        return LeastLoadedRouter()
    if name == "prefix":
        if index is None:
            raise InvalidArgumentError("the prefix router needs a KVRoutingIndex")
        return PrefixRouter(index, block_size, load_weight)
    if name == "dynamo":
        raise InvalidArgumentError("the dynamo router needs a running Dynamo indexer: build "
                                   "kvcore.cluster.dynamo.DynamoRouter (replay_cluster does)")
    raise InvalidArgumentError(f"unknown router {name!r}; choose from {', '.join(ROUTERS)}")
