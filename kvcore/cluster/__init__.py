"""kvcore in a cluster: a KV-aware routing index fed by replicas' KV events, and routers."""

from kvcore.cluster.index import (
    DEFAULT_MEDIUM_WEIGHTS,
    MEDIUM_CPU,
    EventChannel,
    KVRoutingIndex,
    request_keys,
)
from kvcore.cluster.router import (
    ROUTERS,
    LeastLoadedRouter,
    PrefixRouter,
    ReplicaLoad,
    RoundRobinRouter,
    Router,
    make_router,
)

__all__ = ["DEFAULT_MEDIUM_WEIGHTS", "MEDIUM_CPU", "ROUTERS", "EventChannel", "KVRoutingIndex",
           "LeastLoadedRouter", "PrefixRouter", "ReplicaLoad", "RoundRobinRouter", "Router",
           "make_router", "request_keys"]
