"""Fault injection: block hashers that collide on purpose.

A collision makes a prefix-cache lookup find a block computed for other tokens.  With
``verify_hits=True`` kvcore must still never serve one; these hashers make that testable.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvcore.blocks import BlockHash
from kvcore.errors import InvalidArgumentError
from kvcore.hashing import BlockHasher, ExtraKeys

COLLISION_MODES = ("constant", "tokens", "truncated")


class CollidingHasher(BlockHasher):
    """A :class:`~kvcore.hashing.BlockHasher` that collides by design.

    Modes:
        ``constant``: every block hashes to the same value;
        ``tokens``: a block's hash ignores its parent, so equal blocks at other positions or
        after other prefixes collide (the collision a token-only check cannot see);
        ``truncated``: the real chained hash cut to ``bits`` bits (random collisions).
    """

    __slots__ = ("bits", "mode")

    def __init__(self, mode: str = "tokens", *, bits: int = 4, algorithm: str = "xxh3_128") -> None:
        if mode not in COLLISION_MODES:
            raise InvalidArgumentError(
                f"unknown collision mode {mode!r}; choose one of {', '.join(COLLISION_MODES)}")
        if bits.__class__ is not int or not 1 <= bits <= 64:
            raise InvalidArgumentError(f"bits must be an int in [1, 64], got {bits!r}")
        super().__init__(algorithm)
        self.mode = mode
        self.bits = bits

    def hash_block(self, parent: BlockHash | None, token_ids: Sequence[int],
                   extra_keys: ExtraKeys | None = None) -> BlockHash:
        if self.mode == "constant":
            return BlockHash(b"\x00" * 16)
        if self.mode == "tokens":
            return super().hash_block(None, token_ids, extra_keys)
        full = int.from_bytes(super().hash_block(parent, token_ids, extra_keys), "little")
        return BlockHash((full & ((1 << self.bits) - 1)).to_bytes(8, "little"))
