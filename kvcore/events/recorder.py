"""EventRecorder: KV events made where they happen, complete when made.

The pool (and a host tier) call the recorder at the moment blocks enter or leave a prefix cache;
each event is built then, stamped with its group's spec kind and sliding window (as vLLM
publishes them) and its medium, and never rewritten afterwards.  ``take`` hands the pending
events over in order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kvcore._mypyc import mypyc_attr
from kvcore.errors import InvalidArgumentError
from kvcore.events.wire import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    untag_extra_keys,
)
from kvcore.hashing import block_extra_keys, has_extra_keys
from kvcore.specs import KVCacheConfig
from kvcore.types import BlockHash

if TYPE_CHECKING:
    from kvcore.types import KVRequest

GroupStamp = tuple[str | None, int | None]
"""A group's ``(kv_cache_spec_kind, kv_cache_spec_sliding_window)``."""


@mypyc_attr(allow_interpreted_subclasses=True)
class EventRecorder:
    """Pending KV events of one cache (one medium).

    Events are kvcore's (:mod:`kvcore.events.wire`); a subclass that overrides
    ``_stored_event``, ``_removed_event`` and ``_cleared_event`` records another wire type's
    objects with the same content (kvcore inside vLLM records vLLM's own event objects, so
    they need no conversion on the way out).

    Args:
        stamps: per group, the spec kind and sliding window its ``BlockStored`` events carry
            (default: none, for a pool without a model config).
        medium: ``"GPU"`` for the device pool, ``"CPU"`` for a host tier.
        lookahead: the hash lookahead (an int >= 0, see :class:`~kvcore.settings.CacheSettings`).
    """

    __slots__ = ("_pending", "_stamps", "lookahead", "medium")

    # medium and lookahead: object, not str and int: the compiled build would raise TypeError on
    # entry for another type instead of the InvalidArgumentError below.
    def __init__(self, stamps: Sequence[GroupStamp] = (), medium: object = MEDIUM_GPU,
                 lookahead: object = 0) -> None:
        if not isinstance(medium, str):
            raise InvalidArgumentError(f"medium must be a str, got {medium!r}")
        if type(lookahead) is not int or lookahead < 0:
            raise InvalidArgumentError(f"lookahead must be an int >= 0, got {lookahead!r}")
        self._stamps = tuple(stamps)
        self.medium = medium
        self.lookahead = lookahead
        # kvcore's event types (a subclass's ``_*_event`` methods may make others).
        self._pending: list[Any] = []

    @classmethod
    def for_config(cls, config: KVCacheConfig, medium: object = MEDIUM_GPU,
                   lookahead: object = 0) -> EventRecorder:
        """A recorder stamping each group's events with its spec's kind and window
        (``lookahead``: the hash lookahead, see :class:`~kvcore.settings.CacheSettings`)."""
        if not isinstance(config, KVCacheConfig):
            raise InvalidArgumentError(f"config must be a KVCacheConfig, got {config!r}")
        return cls(tuple(g.spec.event_stamp() for g in config.groups), medium, lookahead)

    @property
    def pending(self) -> tuple[KVCacheEvent, ...]:
        """The events recorded since the last ``take`` (read-only)."""
        return tuple(self._pending)

    def take(self) -> list[KVCacheEvent]:
        """The events recorded since the last call, in order; forgets them."""
        events = self._pending
        self._pending = []
        return events

    def _stamp(self, group_id: int) -> GroupStamp:
        stamps = self._stamps
        return stamps[group_id] if 0 <= group_id < len(stamps) else (None, None)

    # -- events -----------------------------------------------------------------------------------
    def stored(self, request: KVRequest, hashes: Sequence[BlockHash], first: int, count: int,
               block_size: int, group_id: int, stored: Sequence[int]) -> None:
        """Blocks ``first .. first+count`` of ``request`` (hashes at ``block_size``) were cached
        in group ``group_id``; ``stored`` are the indices (into that range) of the blocks stored
        now.  Token ids cover the whole range, hashes and extra keys only the stored blocks, as
        vLLM publishes them (no hashes when every block was skipped).  With lookahead hashes,
        each stored block's extra keys cover its lookahead window too, and its lookahead tokens
        are listed."""
        start = first * block_size
        extra: list[tuple[object, ...] | None]
        lookahead = self.lookahead
        ahead: list[tuple[int, ...]] | None = [] if lookahead else None
        tokens = request.all_token_ids
        if self._has_extra_keys(request):
            extra = []
            for i in stored:
                s = (first + i) * block_size
                extra.append(self._extra_keys(request, s, s + block_size + lookahead))
        else:  # (every block's keys are None: not asked block by block)
            extra = [None] * len(stored)
        if ahead is not None:
            for i in stored:
                e = (first + i + 1) * block_size
                ahead.append(tuple(tokens[e:e + lookahead]))
        kind, window = self._stamp(group_id)
        self._pending.append(self._stored_event(
            [hashes[first + i] for i in stored], hashes[first - 1] if first > 0 else None,
            tokens[start:start + count * block_size], block_size, request.lora_id,
            request.lora_name, extra if extra else None,  # vLLM: None for no block
            group_id, kind, window, request.session_id, ahead))

    def stored_keys(self, hashes: Sequence[BlockHash], block_size: int, group_id: int) -> None:
        """Blocks with these hashes entered group ``group_id``'s cache with nothing known of
        their tokens (a placeholder, as vLLM sends for a host tier that was not told)."""
        kind, window = self._stamp(group_id)
        self._pending.append(self._stored_event(
            list(hashes), None, [], block_size, None, None, None, group_id, kind, window, None,
            None))

    def removed(self, block_hash: BlockHash, group_id: int) -> None:
        """The block cached under ``block_hash`` left group ``group_id``'s prefix cache."""
        self._pending.append(self._removed_event(block_hash, group_id))

    def cleared(self) -> None:
        """The whole prefix cache was dropped."""
        self._pending.append(self._cleared_event())

    def _has_extra_keys(self, request: KVRequest) -> bool:
        """Whether any block of ``request`` may have extra keys (:func:`kvcore.hashing.has_extra_keys`);
        a subclass whose ``_extra_keys`` adds keys extends it."""
        return has_extra_keys(request)

    def _extra_keys(self, request: KVRequest, start: int, end: int) -> tuple[object, ...] | None:
        """The published extra keys of the block whose hash covers tokens ``[start, end)``
        (untagged, as vLLM publishes them); a subclass may add keys its requests carry beyond
        kvcore's (vLLM's prompt-embedding digests)."""
        return untag_extra_keys(block_extra_keys(request, start, end))

    # -- the event objects (a subclass may make another wire type's) -------------------------------
    def _stored_event(self, hashes: list[BlockHash], parent: BlockHash | None,
                      token_ids: Sequence[int], block_size: int, lora_id: int | None,
                      lora_name: str | None, extra_keys: list[tuple[object, ...] | None] | None,
                      group_id: int, kind: str | None, window: int | None,
                      session_id: str | None,
                      lookahead_token_ids: list[tuple[int, ...]] | None) -> object:
        return BlockStored(
            block_hashes=tuple(hashes), parent_block_hash=parent, token_ids=tuple(token_ids),
            block_size=block_size, lora_id=lora_id, medium=self.medium, lora_name=lora_name,
            extra_keys=None if extra_keys is None else tuple(extra_keys), group_id=group_id,
            kv_cache_spec_kind=kind, kv_cache_spec_sliding_window=window,
            session_id=session_id,
            lookahead_token_ids=(None if lookahead_token_ids is None
                                 else tuple(lookahead_token_ids)))

    def _removed_event(self, block_hash: BlockHash, group_id: int) -> object:
        return BlockRemoved(block_hashes=(block_hash,), medium=self.medium, group_id=group_id)

    def _cleared_event(self) -> object:
        return AllBlocksCleared()
