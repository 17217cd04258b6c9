"""Typed exceptions raised by kvcore.

Every user-facing error is a subclass of :class:`KVCoreError` and of the builtin
that best describes it (``ValueError`` for bad values, ``KeyError`` for unknown
identifiers), so callers can catch either.  An operation that raises one of these
leaves every structure exactly as it was before the call.
"""

from __future__ import annotations


class KVCoreError(Exception):
    """Base class of every exception kvcore raises on purpose."""


class InvalidArgumentError(KVCoreError, ValueError):
    """An argument has the wrong type or is out of range (negative or oversized counts, ...)."""


class RequestStateError(InvalidArgumentError):
    """A call does not fit the request's state: it was freed (or never admitted) but claims
    computed tokens, it is running and claims a new prefix hit, another live request holds its
    id, or it claims tokens as computed that never had a slot."""


class InvalidHitError(InvalidArgumentError):
    """``new_computed_blocks`` do not form a valid prefix hit for the request: the wrong number
    of blocks for ``num_new_computed_tokens``, blocks of another pool, a null block where the
    next token needs KV, or a block no longer cached under the request's hash (evicted or reused
    since ``get_computed_blocks``; look the hit up again)."""


class StaleHitError(InvalidHitError):
    """A prefix hit that ``get_computed_blocks`` found for this very request lost a block since:
    the pool evicted it (or reset the prefix cache) between the lookup and ``allocate_slots``,
    e.g. for other requests' allocations.  Allocate right after the lookup, or look the request
    up again."""


class NoFreeBlocksError(KVCoreError, ValueError):
    """More blocks were asked for than the free queue holds."""


class BlockStateError(KVCoreError, ValueError):
    """A block operation does not fit the block's state (freeing a free block, removing an unlinked
    block from the free queue, linking a block twice, ...)."""


class DoubleFreeError(BlockStateError):
    """A block was freed more times than it was referenced."""


class NullBlockError(BlockStateError):
    """Something tried to change the null block (its reference count, its hash, its queue links)."""


class InvalidGroupError(KVCoreError, ValueError):
    """A KV-cache group id is out of range, or a block is used with a group it does not belong to."""


class UnknownHashAlgorithmError(InvalidArgumentError):
    """The requested block-hash algorithm is not one kvcore implements."""


class UnknownRequestError(KVCoreError, KeyError):
    """A request id is not known to the manager (never allocated, or already freed)."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable.
        return str(self.args[0]) if self.args else ""


class UnsupportedFeatureError(KVCoreError, ValueError):
    """A configuration asks for a behaviour kvcore does not implement (e.g. a vLLM feature the
    vLLM integration refuses at engine start rather than differ from vLLM silently); the
    message names the feature and the setting that turns it off."""


class ViewAttributeError(UnsupportedFeatureError, AttributeError):
    """A name read or set on one of the vLLM integration's views of vLLM internals (its block
    pool, coordinator, single-type managers, free queue, blocks) that the view does not provide:
    code written against vLLM's own objects reached a vLLM internal kvcore was not checked
    against.  Also an ``AttributeError``, so ``hasattr`` and ``getattr(view, name, default)``
    keep their meaning.  ``view`` and ``name`` say which."""

    def __init__(self, view: str, name: str, *, setting: bool = False) -> None:
        self.view = view
        self.name = name
        what = (f"setting {name!r} on kvcore's {view}: a vLLM internal kvcore's view does not "
                f"let a caller set (the view shows kvcore's own state)" if setting else
                f"reading {name!r} on kvcore's {view}: a vLLM internal kvcore's view does not "
                f"provide")
        super().__init__(
            f"{what}; the caller reached past vLLM's KVCacheManager interface into something "
            f"kvcore was not checked against: run this caller without kvcore")


class InvariantError(KVCoreError, AssertionError):
    """A structural invariant (see DESIGN.md, "Invariants") does not hold.

    ``rule`` names the broken rule, ``block_id`` the block it was observed on (or ``None``), and
    ``observed`` a short description of the offending values.
    """

    def __init__(self, rule: str, message: str, *, block_id: int | None = None,
                 observed: object = None) -> None:
        self.rule = rule
        self.block_id = block_id
        self.observed = observed
        self.detail = message
        where = f" (block {block_id})" if block_id is not None else ""
        super().__init__(f"[{rule}]{where} {message}")
