"""The head-of-line retry: vLLM's scheduler asks again, every step, for the request at the head of
its waiting queue that did not fit, and :class:`RetryMemo` answers from memory while nothing that
decides the answer has changed.

Each step vLLM's scheduler looks up the head's prefix (``get_computed_blocks``) and tries to
admit it (``allocate_slots``); when the pool is short, the allocation fails, the scheduler stops
admitting, and the next step asks the same again.  The memo keeps the latest such request: its
lookup's answer and the allocation that failed.  Both are given again without calling kvcore's
manager while they would come out the same:

* the lookup, for the same request object with as many tokens and block hashes and the same
  ``max_cache_hit_length``, while the pool's ``cache_version`` is unchanged: the pool watches the
  request's block hashes (``BlockPool.watch``), so the version moves when an entry under one of
  them is cached, replaced or evicted, or the cache is reset;
* the failure, for the same request and arguments (the hit handed back being the memo's own),
  while ``cache_version`` is unchanged and the pool's free count has not grown.  The allocation
  needs its new blocks plus its hit blocks that are free; the version also moves when a free
  block is taken by a hit (``touch``, ``pin``), the only way the need shrinks other than an
  eviction of a hit block, which the watch sees.  Blocks allocated to others only lower the free
  count; blocks freed raise it (the memo then lets the call through); hints
  (``declare_upcoming``) move free blocks between the policy and the reserve, which the free
  count sums.  Types with per-step state (Mamba: a state cached this step is not hittable until
  the next) bind a failure recorded while that state is not empty to its own step.

Between a fresh lookup and its failed allocation the pool watches every hash (a request whose
hashes are not the watched ones), so a failure is remembered only if nothing at all changed in
between.  The answers are the same objects as the first time; vLLM's prefix-cache statistics are
recorded at admission only (``record_prefix_cache_stats``, both versions), so a retry answered
from memory counts exactly as one asked again: not at all.  A ``"full"`` report mode's events
for the hit are recorded again by the adapter, as a fresh lookup would.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvcore.block_pool import BlockPool
from kvcore.managers.base import SingleTypeKVCacheManager
from kvcore.types import BlockHash


class _Lookup:
    """A lookup of ``request`` (the adapter's view and kvcore's hit with it), what it answered,
    and the request's state then."""

    __slots__ = ("answer", "cap", "hit", "num_hashes", "num_tokens", "request", "view")

    def __init__(self, request: Any, view: Any, hit: Any, answer: tuple[Any, int, int],
                 cap: int | None, num_tokens: int, num_hashes: int) -> None:
        self.request = request
        self.view = view
        self.hit = hit
        self.answer = answer
        self.cap = cap
        self.num_tokens = num_tokens
        self.num_hashes = num_hashes


class _Failure:
    """A lookup whose allocation failed: the allocation's arguments, the pool's version and free
    count then, the hashes watched for it and the step it is bound to (``None``: any)."""

    __slots__ = ("key", "lookup", "num_free", "step", "version", "watched")

    def __init__(self, lookup: _Lookup, key: tuple[Any, ...], version: int, num_free: int,
                 watched: frozenset[BlockHash], step: int | None) -> None:
        self.lookup = lookup
        self.key = key
        self.version = version
        self.num_free = num_free
        self.watched = watched
        self.step = step


# A fresh lookup not yet known to fail: (request, view, hit, answer, cap, num_tokens, num_hashes,
# the pool's version).  A tuple: made for every admission's lookup, where an object costs more.
_Looked = tuple[Any, Any, Any, tuple[Any, int, int], int | None, int, int, int]


class RetryMemo:
    """The memo of one waiting request's lookup and failed allocation (see the module
    docstring), over kvcore's ``pool`` and its single-type ``managers``.  ``step`` counts the
    scheduler's steps (the adapter's ``new_step_starts``); ``num_lookups_skipped`` and
    ``num_allocations_skipped`` count the answers given from memory."""

    __slots__ = ("_failure", "_looked", "_managers", "num_allocations_skipped",
                 "num_lookups_skipped", "pool", "step")

    def __init__(self, pool: BlockPool, managers: Sequence[SingleTypeKVCacheManager]) -> None:
        self.pool = pool
        self._managers = tuple(managers)
        self.step = 0
        self._looked: _Looked | None = None
        self._failure: _Failure | None = None
        self.num_lookups_skipped = 0
        self.num_allocations_skipped = 0

    def lookup(self, request: Any, cap: int | None) -> _Lookup | None:
        """The remembered lookup of ``request`` if it still holds (the pool's watch back on its
        hashes), else ``None``: the caller looks up afresh and reports it with
        :meth:`looked_up`."""
        failure = self._failure
        if failure is None:
            return None  # (nothing watched then: see forget)
        look = failure.lookup
        pool = self.pool
        if look.request is not request or look.num_hashes != len(request.block_hashes):
            pool.watch(None)  # its hashes are not the watched ones: watch every change
            return None
        if (failure.version != pool.cache_version or look.cap != cap
                or look.num_tokens != request.num_tokens):
            return None
        pool.watch(failure.watched)  # (another request's lookup may have widened it)
        self.num_lookups_skipped += 1
        return look

    def looked_up(self, request: Any, view: Any, hit: Any, answer: tuple[Any, int, int],
                  cap: int | None) -> None:
        """Note a fresh lookup of ``request`` (``answer``: what the adapter returned)."""
        self._looked = (request, view, hit, answer, cap, request.num_tokens,
                        len(request.block_hashes), self.pool.cache_version)

    def refuses(self, request: Any, key: tuple[Any, ...], blocks: object) -> bool:
        """Whether the allocation for ``request`` with arguments ``key`` and hit ``blocks`` is
        one remembered to fail that would fail again (counted)."""
        failure = self._failure
        if (failure is None or failure.lookup.request is not request
                or failure.lookup.answer[0] is not blocks or failure.key != key
                or failure.version != self.pool.cache_version
                or self.pool.num_free_blocks > failure.num_free
                or (failure.step is not None and failure.step != self.step)):
            return False
        self.num_allocations_skipped += 1
        return True

    def failed(self, request: Any, key: tuple[Any, ...], blocks: object) -> None:
        """The allocation for ``request`` with arguments ``key`` and hit ``blocks`` failed:
        remember it if ``blocks`` is the answer of a lookup of it that still holds."""
        pool = self.pool
        version = pool.cache_version
        failure = self._failure
        looked = self._looked
        self._looked = None
        if (looked is not None and looked[0] is request and looked[3][0] is blocks
                and looked[7] == version):
            look = _Lookup(*looked[:7])
        elif (failure is not None and failure.lookup.request is request
                and failure.lookup.answer[0] is blocks and failure.version == version):
            look = failure.lookup  # the remembered lookup, answered again this step
        else:
            return  # not a lookup's answer, or the pool changed since the lookup
        if (failure is not None and failure.lookup.request is request
                and failure.lookup.num_hashes == look.num_hashes):
            watched = failure.watched
        else:
            watched = frozenset(look.view.block_hashes)
        pool.watch(watched)
        step = self.step if any(m.step_state() for m in self._managers) else None
        self._failure = _Failure(look, key, version, pool.num_free_blocks, watched, step)

    def forget(self, request: Any) -> None:
        """``request`` was admitted, or left: nothing of it is remembered any more."""
        failure = self._failure
        if failure is not None and failure.lookup.request is request:
            self._failure = None
            self.pool.watch(None)
        looked = self._looked
        if looked is not None and looked[0] is request:
            self._looked = None
