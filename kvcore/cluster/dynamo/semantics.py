"""What Dynamo's indexer holds, predicted from the same events: to explain where its answers
differ from kvcore's :class:`~kvcore.cluster.index.KVRoutingIndex`.

Rules of ``ai-dynamo-runtime`` 1.6.1's standalone indexer, as measured against kvcore's
publishers (``tests/test_dynamo_interop.py`` checks the real indexer against this model on the
scenarios of ``tests/dynamo_scenarios.py`` and on every query of a seeded run):

1. Only *main-attention* groups count: a ``BlockStored`` whose ``kv_cache_spec_kind`` is
   ``"full_attention"``, or that has no kind and group 0 (or none).  Sliding-window, chunked,
   Mamba and cross-attention groups are ignored, and so are ``BlockRemoved`` events of groups
   it never indexed.  kvcore's index counts a block held in any group.
2. Copies are not counted: the first ``BlockRemoved`` of a block drops it, though the pool still
   holds another copy (two requests that cached the same prefix at once; one block per group
   of a hybrid model).  kvcore's index counts copies.
3. Removing a block drops every block stored below it on that worker, and a ``BlockStored``
   whose parent the worker does not hold is skipped whole.  kvcore's index keeps such blocks
   (its ``match`` stops at the missing parent, and counts them again once it returns).
4. ``AllBlocksCleared`` drops everything of the worker (kvcore's index keeps the host tier).
5. Only the device tier (``medium`` ``"GPU"`` or none) is modelled here.

:class:`DynamoSemantics` applies these rules, and remembers why it lacks a block that the pool
may still hold (``COPIES``, ``GROUP``, ``ORPHAN``), so a disagreement can be named.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence

from kvcore.events import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    ExternalBlockHash,
    KVCacheEvent,
)

MAIN_KIND = "full_attention"
COPIES = "copies"  # dropped by a BlockRemoved while the replica held another copy
GROUP = "group"  # held only in a group Dynamo does not index (or its other copies are there)
ORPHAN = "orphan"  # dropped with, or skipped for lack of, a parent block


class _Worker:
    """One replica's blocks as Dynamo sees them, plus kvcore's copy counts."""

    __slots__ = ("children", "held", "main_copies", "main_groups", "other_copies", "why")

    def __init__(self) -> None:
        self.held: dict[ExternalBlockHash, ExternalBlockHash | None] = {}  # key -> parent
        self.children: dict[ExternalBlockHash, set[ExternalBlockHash]] = {}
        self.main_copies: dict[ExternalBlockHash, int] = {}
        self.other_copies: dict[ExternalBlockHash, int] = {}
        self.main_groups: set[int | None] = set()
        self.why: dict[ExternalBlockHash, str] = {}  # key -> why Dynamo lacks it

    def store(self, event: BlockStored) -> None:
        main = event.kv_cache_spec_kind == MAIN_KIND or (
            event.kv_cache_spec_kind is None and event.group_id in (None, 0))
        copies = self.main_copies if main else self.other_copies
        for key in event.block_hashes:
            copies[key] = copies.get(key, 0) + 1
        if not main:
            for key in event.block_hashes:
                if key not in self.held:
                    self.why[key] = GROUP
            return
        self.main_groups.add(event.group_id)
        parent = event.parent_block_hash
        if parent is not None and parent not in self.held:
            for key in event.block_hashes:
                if key not in self.held:
                    self.why[key] = ORPHAN
            return
        for key in event.block_hashes:
            if key not in self.held:
                self.held[key] = parent
                self.why.pop(key, None)
                if parent is not None:
                    self.children.setdefault(parent, set()).add(key)
            parent = key

    def remove(self, event: BlockRemoved) -> None:
        main = event.group_id in self.main_groups or event.group_id is None
        copies = self.main_copies if main else self.other_copies
        for key in event.block_hashes:
            left = copies.get(key, 0) - 1
            if left > 0:
                copies[key] = left
            else:
                copies.pop(key, None)
            if key not in self.held:
                if key not in self.main_copies and key not in self.other_copies:
                    self.why.pop(key, None)  # the pool no longer holds it either
                continue
            if not main:
                continue
            self._drop(key)
            if self.main_copies.get(key):
                self.why[key] = COPIES
            elif self.other_copies.get(key):
                self.why[key] = GROUP
            else:
                self.why.pop(key, None)

    def _drop(self, key: ExternalBlockHash) -> None:
        """Drop ``key`` and every block below it (marked ``ORPHAN``)."""
        stack = [key]
        while stack:
            k = stack.pop()
            parent = self.held.pop(k, None)
            if parent is not None and (siblings := self.children.get(parent)) is not None:
                siblings.discard(k)
            stack.extend(self.children.pop(k, ()))
            if k != key:
                self.why[k] = ORPHAN

    def clear(self) -> None:
        for table in (self.held, self.children, self.main_copies, self.other_copies, self.why):
            table.clear()


class DynamoSemantics:
    """The rules of the module docstring, per replica: ``apply_events``, ``match``,
    ``why_missing``."""

    def __init__(self) -> None:
        self._workers: dict[Hashable, _Worker] = {}

    def apply_events(self, replica: Hashable, events: Iterable[KVCacheEvent]) -> None:
        worker = self._workers.get(replica)
        if worker is None:
            worker = self._workers[replica] = _Worker()
        for event in events:
            if isinstance(event, BlockStored):
                if (event.medium or MEDIUM_GPU) == MEDIUM_GPU:
                    worker.store(event)
            elif isinstance(event, BlockRemoved):
                if (event.medium or MEDIUM_GPU) == MEDIUM_GPU:
                    worker.remove(event)
            elif isinstance(event, AllBlocksCleared):
                worker.clear()

    def match(self, keys: Sequence[ExternalBlockHash]) -> dict[Hashable, int]:
        """Per replica holding ``keys[0]``: how many leading keys it holds."""
        out: dict[Hashable, int] = {}
        for replica, worker in self._workers.items():
            n = 0
            held = worker.held
            for key in keys:
                if key not in held:
                    break
                n += 1
            if n:
                out[replica] = n
        return out

    def why_missing(self, replica: Hashable, key: ExternalBlockHash) -> str | None:
        """Why Dynamo lacks ``key`` on ``replica`` though the pool may hold it (``COPIES``,
        ``GROUP``, ``ORPHAN``), or ``None`` when it is simply not cached there."""
        worker = self._workers.get(replica)
        return worker.why.get(key) if worker is not None else None
