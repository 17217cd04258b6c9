"""Eviction policies for the block pool's free side, chosen by name: the one home of every policy.

* :mod:`~kvcore.eviction.base`: the :class:`EvictionPolicy` interface;
* :mod:`~kvcore.eviction.lru`: ``lru`` (the default; vLLM's free queue, the intrusive list the
  others are built from);
* :mod:`~kvcore.eviction.slru`, :mod:`~kvcore.eviction.s3fifo`, :mod:`~kvcore.eviction.arc`
  (over :mod:`~kvcore.eviction.segmented`): the other policies the pool runs;
* :mod:`~kvcore.eviction.offline`: ``fifo``, ``lfu``, ``belady`` and ``reuse_oracle``, for the
  simulator only;
* :mod:`~kvcore.eviction.registry`: name -> class, read by every entry point;
  :func:`register_policy` adds your own.

``make_policy("slru:protected_share=0.3,ghost_factor=2", blocks)`` builds one with options;
:data:`RECOMMENDED` names the configuration the README recommends.
"""

from __future__ import annotations

from kvcore.eviction.base import EvictionPolicy, FreeList
from kvcore.eviction.lru import FreeBlockQueue
from kvcore.eviction.registry import (
    OFFLINE_BOUND,
    RECOMMENDED,
    RECOMMENDED_NAME,
    REGISTRY,
    REUSE_ORACLE,
    PolicyFactory,
    make_policy,
    parse_policy,
    register_policy,
    unregister_policy,
)

# What a user of the pool, the registry or the CLI needs, and the two bases a new policy builds
# on; each policy class is imported from its module (kvcore.eviction.slru.SLRUPolicy, ...).
__all__ = [
    "OFFLINE_BOUND",
    "RECOMMENDED",
    "RECOMMENDED_NAME",
    "REGISTRY",
    "REUSE_ORACLE",
    "EvictionPolicy",
    "FreeBlockQueue",
    "FreeList",
    "PolicyFactory",
    "make_policy",
    "parse_policy",
    "register_policy",
    "unregister_policy",
]
