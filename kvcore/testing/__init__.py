"""Test support for code built on kvcore: a content oracle that knows what every KV slot holds,
deliberately colliding block hashers, and a driver that mixes valid and hostile calls.

Nothing here is imported by ``import kvcore``; it has no dependency beyond kvcore's own.
"""

from kvcore.testing.faults import COLLISION_MODES, CollidingHasher
from kvcore.testing.oracle import ContentOracle, WrongKVError

__all__ = ["COLLISION_MODES", "CollidingHasher", "ContentOracle", "WrongKVError"]
