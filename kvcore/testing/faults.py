"""Fault injection: block hashers that collide on purpose (everywhere, or where you plant
it), an allocation that fails at chosen calls, and a manual clock.

A collision makes a prefix-cache lookup find a block computed for other tokens.  With
``verify_hits=True`` kvcore must still never serve one; these hashers make that testable.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from kvcore.errors import InvalidArgumentError
from kvcore.hashing import BlockHasher, ExtraKeys
from kvcore.testing._layers import add_layer
from kvcore.types import BlockHash

if TYPE_CHECKING:
    from kvcore.manager import KVCacheManager

    _Layer = KVCacheManager  # what the mixin's super() calls reach
else:
    _Layer = object

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


class PlantedCollisions(BlockHasher):
    """A real hasher, except for the collisions you plant: after ``collide(a, b)`` a block whose
    tokens are ``a`` hashes as if its tokens were ``b`` (same parent, same extra keys), so the
    two blocks collide exactly where you want them to."""

    __slots__ = ("_planted",)

    def __init__(self, algorithm: str = "xxh3_128") -> None:
        super().__init__(algorithm)
        self._planted: dict[tuple[int, ...], tuple[int, ...]] = {}

    def collide(self, tokens: Sequence[int], as_tokens: Sequence[int]) -> None:
        if len(tokens) != len(as_tokens):
            raise InvalidArgumentError("colliding blocks must have the same number of tokens")
        self._planted[tuple(tokens)] = tuple(as_tokens)

    def hash_block(self, parent: BlockHash | None, token_ids: Sequence[int],
                   extra_keys: ExtraKeys | None = None) -> BlockHash:
        planted = self._planted.get(tuple(token_ids))
        return super().hash_block(parent, token_ids if planted is None else planted, extra_keys)


class _Refusals:
    __slots__ = ("calls", "count", "error")

    def __init__(self, calls: set[int], error: BaseException | None) -> None:
        self.calls = calls
        self.error = error
        self.count = 0


class RefusingAllocation(_Layer):
    """The layer :func:`refuse_allocation` puts on a manager's class (see
    :mod:`kvcore.testing._layers`)."""

    __slots__ = ()
    _kvcore_refusals: _Refusals  # a class attribute of the manager's own layer class

    def allocate_slots(self, *args: Any, **kwargs: Any) -> Any:
        refusals = self._kvcore_refusals
        refusals.count += 1
        if refusals.count in refusals.calls:
            if refusals.error is not None:
                raise refusals.error
            return None
        return super().allocate_slots(*args, **kwargs)


def refuse_allocation(manager: KVCacheManager, calls: Iterable[int], *,
                      error: BaseException | None = None) -> KVCacheManager:
    """Make ``manager.allocate_slots`` return ``None`` (not enough blocks: preempt someone) on
    the listed calls, counted from 1 from now, without touching the manager's state — as if the
    pool had run out at those moments.  Exercises a scheduler's preemption and retry paths.
    With ``error``, those calls raise it instead (a failure in the middle of a step).

    The manager keeps its identity (it gets a class of its own, as with
    :func:`~kvcore.testing.checked`); calls after the listed ones go through unchanged."""
    add_layer(manager, RefusingAllocation, _kvcore_refusals=_Refusals(set(calls), error))
    return manager


class ManualClock:
    """A clock that moves only when told to, for replay-style tests: ``now()`` in seconds,
    ``advance(dt)``; ``sleep(dt)`` advances instead of sleeping."""

    __slots__ = ("_now",)

    def __init__(self, start: float = 0.0) -> None:
        self._now = float(start)

    def now(self) -> float:
        return self._now

    def advance(self, seconds: float) -> float:
        if not seconds >= 0:  # also refuses NaN
            raise InvalidArgumentError(f"a clock cannot go back or by NaN: {seconds!r}")
        self._now += seconds
        return self._now

    sleep = advance
