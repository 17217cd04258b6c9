"""Argument checks as functions: each returns the value in its plain type or raises
:class:`~kvcore.errors.InvalidArgumentError` naming it, before anything changes.

Public entry points (the manager's, the pool's, the settings') annotate counts as
``SupportsIndex`` and flags as ``object`` on purpose: both builds must apply the one rule below.
Annotated ``int``, the compiled build would take ``True`` as 1 and refuse ``numpy.int64`` with
its own ``TypeError``, where the pure build accepts the integer and refuses the bool
(``tests/test_bad_inputs.py`` pins the rule for both).  Internal signatures say ``int``.

The rule for flags: a flag is a real ``bool`` (:func:`check_flag`); ``1``, ``"no"``, ``None``
and ``numpy.bool_`` are refused, never read for their truth.  Where a flag is on a hot path the
caller tests ``flag is False`` / ``flag is True`` (one pointer comparison in both builds) and
calls :func:`check_flag` only when it is neither.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable
from typing import TypeVar

from kvcore.errors import InvalidArgumentError
from kvcore.types import BlockHash, KVCacheBlock

T = TypeVar("T")


def check_count(name: str, value: object) -> int:
    """``value`` as a non-negative int, else :class:`InvalidArgumentError` naming ``name``: the
    one rule for every count kvcore is given (the pool's and the manager's).  Integers of other
    types (numpy's) are accepted and converted; bools are refused."""
    if type(value) is int and value >= 0:  # the common case, without the ABC check
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or int(value) < 0:
        # (int(value) < 0: numpy's comparisons return numpy.bool, which the compiled build's
        # ``or`` refuses.)
        raise InvalidArgumentError(f"{name} must be a non-negative int, got {value!r}")
    return int(value)


def check_counts(num_new_tokens: object, num_new_computed_tokens: object,
                 num_lookahead_tokens: object, num_external_computed_tokens: object,
                 num_encoder_tokens: object) -> tuple[int, int, int, int, int]:
    """``allocate_slots``' token counts as plain ints (see :func:`check_count`).  Its block
    counts (``reserved_blocks``, ``watermark_blocks``) are checked by the caller only when they
    are not 0: two more counts here cost ~100 instructions of every checked compiled call
    (BENCHMARKS.md 2026-11-27, issue 37's compiled residual)."""
    # (type(x): one pointer comparison in the compiled build, where x.__class__ is an attribute
    # lookup.)
    if (type(num_new_tokens) is int and num_new_tokens >= 0
            and type(num_new_computed_tokens) is int and num_new_computed_tokens >= 0
            and type(num_lookahead_tokens) is int and num_lookahead_tokens >= 0
            and type(num_external_computed_tokens) is int and num_external_computed_tokens >= 0
            and type(num_encoder_tokens) is int and num_encoder_tokens >= 0):
        return (num_new_tokens, num_new_computed_tokens, num_lookahead_tokens,
                num_external_computed_tokens, num_encoder_tokens)  # plain ints: nothing to do
    return (check_count("num_new_tokens", num_new_tokens),
            check_count("num_new_computed_tokens", num_new_computed_tokens),
            check_count("num_lookahead_tokens", num_lookahead_tokens),
            check_count("num_external_computed_tokens", num_external_computed_tokens),
            check_count("num_encoder_tokens", num_encoder_tokens))


def check_flag(name: str, value: object) -> bool:
    """``value`` if it is a bool, else :class:`InvalidArgumentError` naming ``name``."""
    if not isinstance(value, bool):
        raise InvalidArgumentError(f"{name} must be a bool, got {value!r}")
    return value


def check_collection(what: str, items: Iterable[T]) -> list[T]:
    """``items`` as a list if it is a collection (a list, a tuple, any other iterable but a str,
    bytes or a single block), else :class:`InvalidArgumentError` naming ``what`` and the value.
    The items themselves are the caller's to check."""
    if type(items) is list:
        return items
    # (Tested as an object: typed Iterable, a value that is none would be narrowed to the
    # excluded types, and the compiled build would cast it to them, raising its own TypeError.)
    value: object = items
    if isinstance(value, (str, bytes, KVCacheBlock)) or not isinstance(value, Iterable):
        raise InvalidArgumentError(f"{what} must be a collection (a list or a tuple), got "
                                   f"{value!r:.80}")
    return list(items)


def check_share(name: str, value: object, low: float = 0.0, high: float = 1.0) -> float:
    """``value`` as a float in ``[low, high]``, or :class:`InvalidArgumentError` naming it."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise InvalidArgumentError(f"{name} must be a number in [{low}, {high}], got {value!r}")
    return float(value)


def check_hashes(hashes: object) -> list[BlockHash]:
    """A collection of block hashes as a list, or :class:`InvalidArgumentError` naming the bad
    value."""
    if isinstance(hashes, (str, bytes)) or not isinstance(hashes, Iterable):
        raise InvalidArgumentError(f"block hashes must be a collection of bytes, got {hashes!r:.80}")
    out = list(hashes)
    for h in out:
        if type(h) is not bytes:
            raise InvalidArgumentError(f"a block hash must be bytes, got {h!r:.80}")
    return out
