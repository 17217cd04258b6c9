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
"""

from __future__ import annotations

from collections.abc import Sequence
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
    """Base: ``route`` returns the index of the chosen replica in ``loads``."""

    name = "router"

    def route(self, keys: Sequence[ExternalBlockHash], num_prompt_tokens: int,
              loads: Sequence[ReplicaLoad]) -> int:
        raise NotImplementedError


def _load_key(load: ReplicaLoad, i: int) -> tuple[int, float, int, int]:
    return (load.pending_tokens, load.usage, load.num_requests, i)


def _least_loaded(loads: Sequence[ReplicaLoad]) -> int:
    return min(range(len(loads)), key=lambda i: _load_key(loads[i], i))


class RoundRobinRouter(Router):
    name = "round-robin"

    def __init__(self) -> None:
        self._next = 0

    def route(self, keys: Sequence[ExternalBlockHash], num_prompt_tokens: int,
              loads: Sequence[ReplicaLoad]) -> int:
        i = self._next % len(loads)
        self._next = i + 1
        return i


class LeastLoadedRouter(Router):
    name = "least-loaded"

    def route(self, keys: Sequence[ExternalBlockHash], num_prompt_tokens: int,
              loads: Sequence[ReplicaLoad]) -> int:
        return _least_loaded(loads)


class PrefixRouter(Router):
    """Lowest ``load_weight × pending tokens + tokens to compute`` (see the module doc)."""

    name = "prefix"

    def __init__(self, index: KVRoutingIndex, block_size: int, load_weight: float = 1.0) -> None:
        if type(block_size) is not int or block_size <= 0:
            raise InvalidArgumentError(f"block_size must be a positive int, got {block_size!r}")
        if not isinstance(load_weight, (int, float)) or isinstance(load_weight, bool) \
                or not load_weight >= 0:
            raise InvalidArgumentError(f"load_weight must be a number >= 0, got {load_weight!r}")
        self.index = index
        self.block_size = block_size
        self.load_weight = float(load_weight)

    def route(self, keys: Sequence[ExternalBlockHash], num_prompt_tokens: int,
              loads: Sequence[ReplicaLoad]) -> int:
        matches = self.index.match(keys)
        bs = self.block_size

        def cost(i: int) -> tuple[float, tuple[int, float, int, int]]:
            score = matches[i][1] if i in matches else 0.0
            load = loads[i]
            return (self.load_weight * load.pending_tokens + num_prompt_tokens - score * bs,
                    _load_key(load, i))

        return min(range(len(loads)), key=cost)


ROUTERS = ("prefix", "round-robin", "least-loaded")


def make_router(name: str, index: KVRoutingIndex | None = None, block_size: int = 16,
                load_weight: float = 1.0) -> Router:
    """A router by name (``ROUTERS``); ``prefix`` needs the index."""
    if name == "round-robin":
        return RoundRobinRouter()
    if name == "least-loaded":
        return LeastLoadedRouter()
    if name == "prefix":
        if index is None:
            raise InvalidArgumentError("the prefix router needs a KVRoutingIndex")
        return PrefixRouter(index, block_size, load_weight)
    raise InvalidArgumentError(f"unknown router {name!r}; choose from {', '.join(ROUTERS)}")
