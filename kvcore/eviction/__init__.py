"""Eviction policies for the block pool's free side, chosen by name.

``lru`` (the default; vLLM's free queue), ``slru`` (segmented LRU with a ghost table),
``s3fifo`` (S3-FIFO) and ``arc`` (Adaptive Replacement Cache).
``make_policy("slru:protected_share=0.3,ghost_factor=2", blocks)`` builds one with options; :data:`RECOMMENDED` names the configuration the README recommends.
The simulator (:mod:`kvcore.sim.policies`) runs these same classes, plus offline-only ones.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

from kvcore.blocks import FreeBlockQueue, KVCacheBlock
from kvcore.errors import InvalidArgumentError
from kvcore.eviction.arc import ARCPolicy
from kvcore.eviction.s3fifo import S3FIFOPolicy
from kvcore.eviction.slru import SLRUPolicy
from kvcore.policy import EvictionPolicy


def _lru(blocks: Sequence[KVCacheBlock]) -> EvictionPolicy:
    return FreeBlockQueue(blocks)


def _slru(blocks: Sequence[KVCacheBlock], **options: object) -> EvictionPolicy:
    return SLRUPolicy(blocks, **options)


def _s3fifo(blocks: Sequence[KVCacheBlock], **options: object) -> EvictionPolicy:
    return S3FIFOPolicy(blocks, **options)


def _arc(blocks: Sequence[KVCacheBlock], **options: object) -> EvictionPolicy:
    return ARCPolicy(blocks, **options)


POOL_POLICIES: dict[str, Callable[..., EvictionPolicy]] = {
    "lru": _lru, "slru": _slru, "s3fifo": _s3fifo, "arc": _arc}
"""Policies the real pool runs, by name."""

LRUPolicy = FreeBlockQueue


class Recommendation(NamedTuple):
    policy: str
    queue_hints: int


RECOMMENDED = Recommendation("slru:protected_share=0.7", 128)
"""The configuration the README recommends (``kvcore replay --eviction-policy recommended``):
measured on the shipped Mooncake trace with the scheduler replay, see BENCHMARKS.md."""


def parse_policy(spec: object) -> tuple[str, dict[str, object]]:
    """``"name"`` or ``"name:key=value,..."`` → (name, options); values are numbers."""
    if not isinstance(spec, str) or not spec.strip():
        raise InvalidArgumentError(f"eviction policy must be a name, got {spec!r}")
    name, _, rest = spec.strip().partition(":")
    if name not in POOL_POLICIES:
        raise InvalidArgumentError(f"unknown eviction policy {name!r}; choose one of "
                                   f"{', '.join(POOL_POLICIES)}")
    options: dict[str, object] = {}
    for item in filter(None, (part.strip() for part in rest.split(","))):
        key, eq, value = item.partition("=")
        try:
            if not eq:
                raise ValueError
            options[key.strip()] = float(value)
        except ValueError:
            raise InvalidArgumentError(
                f"eviction policy option {item!r} in {spec!r} is not key=number") from None
    return name, options


PolicyFactory = Callable[[Sequence[KVCacheBlock]], EvictionPolicy]


def make_policy(spec: object, blocks: Sequence[KVCacheBlock]) -> EvictionPolicy:
    """Build the policy ``spec`` names (see :func:`parse_policy`) over ``blocks``, all free, in
    their initial reuse order.  ``spec`` may also be a factory ``blocks -> EvictionPolicy`` (a
    policy of your own, or the simulator's offline bound)."""
    if callable(spec):
        policy = spec(blocks)
        if not isinstance(policy, EvictionPolicy) or len(policy) != len(blocks):
            raise InvalidArgumentError(
                f"eviction policy factory {spec!r} must return an EvictionPolicy holding the "
                f"{len(blocks)} blocks it was given, got {policy!r}")
        return policy
    name, options = parse_policy(spec)
    try:
        return POOL_POLICIES[name](blocks, **options)
    except TypeError:
        raise InvalidArgumentError(
            f"eviction policy {name!r} takes no option among {', '.join(options)}") from None


__all__ = [
    "POOL_POLICIES",
    "RECOMMENDED",
    "ARCPolicy",
    "EvictionPolicy",
    "LRUPolicy",
    "PolicyFactory",
    "S3FIFOPolicy",
    "SLRUPolicy",
    "make_policy",
    "parse_policy",
]
