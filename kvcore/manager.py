"""KVCacheManager: the scheduler's contract with the KV cache.

A scheduler admits a request with ``get_computed_blocks`` (its prefix hit) and
``allocate_slots`` (slots for the tokens it will compute this step), grows it with further
``allocate_slots`` calls, and ends it with ``free``.  ``allocate_slots`` returning ``None`` means
"not enough free blocks: preempt someone" and changes nothing at all.

Token layout of one ``allocate_slots`` call::

    | computed | new_computed | external_computed | new | lookahead |
    |<- request.num_computed_tokens
               |<- local prefix hit (blocks from get_computed_blocks)
                              |<- computed elsewhere (a KV connector)
                                                  |<- computed this step
                                                        |<- draft slots
               |<------------------ slots allocated ------------------>|
    |<------- cached: up to the request's real tokens ------->|

Blocks are cached only up to ``request.num_tokens`` (draft/lookahead tokens never).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Final, NoReturn, SupportsIndex

from kvcore._mypyc import mypyc_attr
from kvcore.block_pool import BlockPool
from kvcore.coordinator import make_coordinator
from kvcore.coordinator.base import KVCacheCoordinator
from kvcore.errors import (
    BlockStateError,
    InvalidArgumentError,
    InvalidGroupError,
    InvalidHitError,
    NoFreeBlocksError,
    RequestStateError,
    StaleHitError,
    UnknownRequestError,
)
from kvcore.events import EventRecorder, KVCacheEvent
from kvcore.eviction.base import Release
from kvcore.hashing import BlockHasher, hashes_at, num_hashable_blocks
from kvcore.request import Request, RequestBlockHasher, RequestLike
from kvcore.settings import CacheSettings
from kvcore.specs import KVCacheConfig
from kvcore.types import BlockHash, KVCacheBlock, KVCacheBlocks, KVRequest, LookupHit
from kvcore.validation import check_collection, check_count, check_counts, check_flag
from kvcore.verify import HitVerifier

_ZERO: Final = 0  # the default count; see the fast path of allocate_slots


@dataclass
class PrefixCacheStats:
    """Lookups since the last ``make_prefix_cache_stats()``.

    ``queries``/``hits`` count tokens; a request that was preempted before is counted in the
    ``preempted_*`` fields instead (its re-admission mostly hits its own blocks, which would
    inflate the hit rate).  ``reset`` is set when the prefix cache was reset in the interval.
    """

    requests: int = 0
    queries: int = 0
    hits: int = 0
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0
    reset: bool = False

    def record(self, num_tokens: int, num_hits: int, preempted: bool) -> None:
        if preempted:
            self.preempted_requests += 1
            self.preempted_queries += num_tokens
            self.preempted_hits += num_hits
        else:
            self.requests += 1
            self.queries += num_tokens
            self.hits += num_hits

    @property
    def hit_rate(self) -> float:
        """Token hit rate of first-time lookups (0.0 when there were none)."""
        return self.hits / self.queries if self.queries else 0.0


def evictions_since_lookup(hits: object, request: object, pool: BlockPool) -> int:
    """How many blocks ``pool`` evicted since ``get_computed_blocks`` found ``hits`` for
    ``request`` (a reset of its prefix cache, or entries moved off a block that stays cached
    for its writer, ``BlockPool.num_invalidations``, count as one more); 0 if none, or if ``hits`` is
    not that lookup's result (another request's, or built by hand).  A hit with evictions since
    its own lookup that no longer holds the request's prefix went stale between lookup and
    allocation: the manager raises :class:`StaleHitError` then, and ``kvcore.testing.checked``
    leaves that error as it is."""
    lookup = getattr(hits, "lookup", None) if isinstance(hits, LookupHit) else None
    if lookup is None or lookup[0] is not request:
        return 0
    return pool.num_evicted_blocks - lookup[2] + (pool.num_invalidations != lookup[3])


def lookup_boundary(hits: object, request: object) -> int:
    """The shared-prefix boundary ``get_computed_blocks`` found along with ``hits`` for
    ``request`` (vLLM's ``shared_prefix_boundary``: with several groups, the longest prefix one
    group found cached when it is longer than the hit they all agree on); 0 if there was none, or
    if ``hits`` is not that lookup's result (another request's, or built by hand)."""
    if type(hits) is LookupHit and hits.lookup[0] is request:
        return hits.shared_prefix_boundary
    return 0


# Functions called with every manager KVCacheManager.__init__ has built (add_construction_hook):
# the seam through which ``pytest --kvcore-check`` checks every manager a test builds.
_construction_hooks: list[Callable[[KVCacheManager], object]] = []


def add_construction_hook(hook: Callable[[KVCacheManager], object]) -> Callable[[], None]:
    """Call ``hook(manager)`` at the end of every ``KVCacheManager.__init__`` from now on (for test
    tools such as kvcore's pytest plugin); returns the function that removes it again."""
    _construction_hooks.append(hook)

    def remove() -> None:
        if hook in _construction_hooks:
            _construction_hooks.remove(hook)

    return remove


# Subclasses defined outside the compiled build (a user's manager, kvcore.testing's checked
# managers) are allowed; compiled calls on their instances dispatch through Python.
@mypyc_attr(allow_interpreted_subclasses=True)
class KVCacheManager:
    """Block tables for every running request, over one shared pool with prefix caching.

    Args:
        config: the model's KV-cache groups and the pool size.
        max_model_len: the longest sequence a request may reach.
        max_num_batched_tokens: the scheduler's per-step token budget; bounds the blocks a
            sliding-window / chunked-local request needs at once for ``full_sequence_must_fit``.
        settings: every other option, one :class:`~kvcore.settings.CacheSettings` (prefix
            caching, eviction policy, events, hit verification, EAGLE, hashing, custom attention
            types, validation fast path, stats); see there.
        events: where the pool records KV events when they are on (default: an
            :class:`~kvcore.events.EventRecorder` of kvcore's event types, stamped with each
            group's spec; kvcore inside vLLM passes one that makes vLLM's event objects).
        **options: :class:`CacheSettings` fields, a shorthand for ``settings=``
            (``KVCacheManager(config, 4096, eviction_policy="slru", enable_events=True)``).

    Arguments that the manager checks itself are annotated with types that the compiled build
    does not check on entry (``object``, ``SupportsIndex``: an ``int`` parameter would take
    ``True`` as 1), so both builds refuse bad values with the same typed errors.
    """

    # Fixed attributes, as in the compiled build (whose instances have no __dict__): the two
    # builds' objects have the same layout, which kvcore.testing's checked() relies on.
    __slots__ = ("_admission_caps", "_block_sizes", "_empty", "_held_free", "_keeps_boundaries",
                 "_reads_releases", "_requests", "_sole_full_attention", "_steady_steps",
                 "_withheld",
                 "block_hasher", "config", "coordinator", "enable_caching", "fast_path",
                 "hash_block_size", "log_stats", "max_model_len", "max_num_batched_tokens",
                 "num_groups", "num_hash_lookahead_tokens", "pool", "prefix_cache_stats",
                 "settings", "verify_hits")

    def __init__(self, config: KVCacheConfig, max_model_len: SupportsIndex, *,
                 max_num_batched_tokens: SupportsIndex | None = None,
                 settings: CacheSettings | None = None, events: object = None,
                 **options: Any) -> None:
        if not isinstance(config, KVCacheConfig):
            raise InvalidArgumentError(f"config must be a KVCacheConfig, got {config!r}")
        if type(max_model_len) is not int or max_model_len <= 0:
            raise InvalidArgumentError(f"max_model_len must be a positive int, got {max_model_len!r}")
        if max_num_batched_tokens is not None and (
                type(max_num_batched_tokens) is not int or max_num_batched_tokens <= 0):
            raise InvalidArgumentError("max_num_batched_tokens must be a positive int or None, "
                                       f"got {max_num_batched_tokens!r}")
        settings = CacheSettings._of(settings, options)
        self.settings = settings
        self.config = config
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_caching = settings.enable_caching
        self.verify_hits = settings.verify_hits and settings.enable_caching
        self.fast_path = settings.fast_path
        self.num_hash_lookahead_tokens = lookahead = settings.num_hash_lookahead_tokens
        self.block_hasher = RequestBlockHasher(
            config.hash_block_size,
            settings.block_hasher if settings.block_hasher is not None
            else BlockHasher(settings.hash_algo, settings.hash_seed), lookahead)
        if events is None:
            events = EventRecorder.for_config(config, lookahead=lookahead)
        self.pool = BlockPool(config.num_blocks, num_groups=config.num_groups, settings=settings,
                              events=events)
        self.coordinator: KVCacheCoordinator = make_coordinator(config, self.pool, settings)
        # A policy that reads releases (EvictionPolicy.reads_releases) is told each request's
        # blocks before they are freed; the others cost nothing more on the free path.
        self._reads_releases = self.pool.policy.reads_releases and settings.enable_caching
        self._block_sizes = tuple(m.block_size for m in self.coordinator.managers)
        self.hash_block_size = config.hash_block_size
        self.num_groups = config.num_groups
        self.log_stats = settings.log_stats
        self.prefix_cache_stats: PrefixCacheStats | None = (
            PrefixCacheStats() if settings.log_stats else None)
        # request id -> [request, num_slots]: the request object holding the blocks and how many
        # tokens it has slots for.  A two-item list, not a __slots__ record: building the record
        # costs 140 ns in pure Python against 56 ns for the list (timeit, CPython 3.11), about
        # 2% of a caching-off admission (BENCHMARKS.md 2026-11-27, issue 37).
        self._requests: dict[str, list[Any]] = {}
        # Deferred frees: block id -> references pop_blocks_for_free handed out and
        # free_withheld has not returned yet.
        self._withheld: dict[int, int] = self.coordinator.withheld  # (shared with its managers)
        # Free blocks set_num_free_blocks holds back, the first reused first when given back.
        self._held_free: list[KVCacheBlock] = []
        # Whether a request keeps its lookup's shared-prefix boundary while it runs: sparse
        # retention caches before it, shared-prefix checkpoints key the Mamba state at it.
        self._keeps_boundaries = (config.prefix_cache_retention_interval is not None
                                  or self.coordinator.shared_prefix_checkpoint)
        self._empty = KVCacheBlocks(() for _ in range(self.num_groups))
        self._sole_full_attention = self.coordinator.sole_full_attention
        self._steady_steps = self.coordinator.steady_steps
        self._admission_caps = tuple(
            g.spec.max_blocks_per_request(max_model_len, max_num_batched_tokens)
            if g.spec.admission_capped else None for g in config.groups)
        for hook in _construction_hooks:
            hook(self)

    # -- requests -------------------------------------------------------------------------------
    def make_request(self, request_id: str, prompt_token_ids: Sequence[int],
                     **kwargs: Any) -> Request:
        """A :class:`Request` hashed with this manager's algorithm, seed and block size."""
        return Request(request_id, prompt_token_ids, block_hasher=self.block_hasher, **kwargs)

    @property
    def num_running_requests(self) -> int:
        return len(self._requests)

    # -- the scheduler's calls ------------------------------------------------------------------
    def get_computed_blocks(self, request: RequestLike,
                            max_cache_hit_length: SupportsIndex | None = None
                            ) -> tuple[KVCacheBlocks, int]:
        """The request's prefix hit: per-group blocks and the number of hit tokens.

        Reference counts are not changed (``allocate_slots`` takes the blocks).  The hit never
        covers the last token, whose logits must be computed, nor more than
        ``max_cache_hit_length`` tokens when that is given (a caller's own bound, e.g. what a
        side store also holds).
        """
        cap = (None if max_cache_hit_length is None
               else check_count("max_cache_hit_length", max_cache_hit_length))
        if not self.enable_caching or request.skip_reading_prefix_cache:
            return self._empty, 0
        max_length = request.num_tokens - 1
        if cap is not None and cap < max_length:
            max_length = cap
        self._sync_hashes(request)
        blocks, num_hit_tokens, boundary = self.coordinator.find_longest_cache_hit(
            request.block_hashes, max_length,
            HitVerifier(request, self.num_hash_lookahead_tokens) if self.verify_hits else None)
        if not boundary and not any(blocks):
            return self._empty, num_hit_tokens  # (the common miss: nothing to stamp)
        # Immutable per-group tuples stamped with their lookup (LookupHit): handed back unchanged
        # to allocate_slots for the same request with nothing evicted since, the hit needs no
        # re-check (only eviction or a reset can change what its blocks hold), and one whose
        # blocks were evicted since is told stale.  The stamp carries the lookup's shared-prefix
        # boundary to the request's admission (an empty hit is stamped for it too): the lookup
        # itself changes no state.
        hit = LookupHit(map(tuple, blocks))
        pool = self.pool
        hit.lookup = (request, num_hit_tokens, pool.num_evicted_blocks, pool.num_invalidations)
        if boundary:
            hit.shared_prefix_boundary = boundary
        return hit, num_hit_tokens

    def shared_prefix_boundary(self, request: KVRequest) -> int:
        """Deprecated: the boundary travels with the hit ``get_computed_blocks`` returns (read
        it with :func:`lookup_boundary`).  The shared-prefix boundary of a fresh lookup of
        ``request`` (vLLM's ``shared_prefix_boundary``): with several groups, the longest prefix
        one group found cached when it is longer than the hit they all agree on.  Under sparse
        retention the request, once admitted, keeps its sliding-window blocks before that
        boundary cached, so a sibling can resume there."""
        warnings.warn("KVCacheManager.shared_prefix_boundary is deprecated: read the boundary "
                      "from get_computed_blocks' hit with kvcore.manager.lookup_boundary",
                      DeprecationWarning, stacklevel=2)
        return lookup_boundary(self.get_computed_blocks(request)[0], request)

    def report_prefix_hit(self, request: KVRequest, hit: Sequence[Sequence[KVCacheBlock]]) -> None:
        """Record a ``BlockStored`` event per group for the hit blocks ``get_computed_blocks``
        returned for ``request`` (null positions included), as vLLM does for a request with
        ``kv_cache_report_mode="full"``; nothing without events.  A ``hit`` that is not one
        list of this pool's blocks per group raises, recording nothing."""
        if not isinstance(hit, (tuple, list)) or len(hit) != self.num_groups:
            raise InvalidArgumentError(f"hit must hold one block list per group "
                                       f"({self.num_groups}), got {hit!r:.80}")
        for g, (m, blocks) in enumerate(zip(self.coordinator.managers, hit)):
            if not isinstance(blocks, (tuple, list)):
                raise InvalidArgumentError(f"hit must hold one block list per group, got "
                                           f"{blocks!r:.80} for group {g}")
            self._own_blocks("report_prefix_hit", blocks)  # raises naming a stranger
            hashes = hashes_at(request.block_hashes, self.hash_block_size, m.block_size)
            if len(blocks) > len(hashes):  # (checked for every group before any is reported)
                raise InvalidArgumentError(f"hit: {len(blocks)} blocks for group {g} exceed the "
                                           f"request's {len(hashes)} block hashes")
        self.coordinator.report_prefix_hit(request, hit)

    def record_prefix_cache_stats(self, request: RequestLike,
                                  num_hit_tokens: SupportsIndex) -> None:
        """Count one prefix-cache query of ``request`` that hit ``num_hit_tokens`` tokens.

        As in vLLM, a scheduler calls this once per admission, after ``allocate_slots``
        succeeded (lookups of a request that did not fit are not queries); requests that were
        preempted before are counted apart (``preempted_*``).  Nothing is counted with caching
        off or for a request that skips reading the prefix cache (no lookup happened)."""
        if type(num_hit_tokens) is not int or num_hit_tokens < 0:
            num_hit_tokens = check_count("num_hit_tokens", num_hit_tokens)
        stats = self.prefix_cache_stats
        if stats is not None and self.enable_caching and not request.skip_reading_prefix_cache:
            stats.record(request.num_tokens, num_hit_tokens, request.num_preemptions > 0)

    def allocate_slots(
        self,
        request: RequestLike,
        num_new_tokens: SupportsIndex,
        num_new_computed_tokens: SupportsIndex = 0,
        new_computed_blocks: Sequence[Sequence[KVCacheBlock]] | None = None,
        num_lookahead_tokens: SupportsIndex = 0,
        num_external_computed_tokens: SupportsIndex = 0,
        delay_cache_blocks: object = False,
        num_encoder_tokens: SupportsIndex = 0,
        full_sequence_must_fit: object = False,
        reserved_blocks: SupportsIndex = 0,
        watermark_blocks: SupportsIndex = 0,
        shared_prefix_boundary: SupportsIndex | None = None,
    ) -> KVCacheBlocks | None:
        """Slots for ``num_new_tokens`` (+ lookahead) tokens after the computed ones (see the
        module docstring's layout).  Returns the newly allocated blocks per group, or ``None``
        (nothing changed) when the pool cannot supply them while leaving ``reserved_blocks``
        free blocks for requests already in flight (vLLM's gate for async KV loads; the
        ``full_sequence_must_fit`` check does not count them, as in vLLM) and
        ``watermark_blocks`` more (vLLM's admission watermark, which a scheduler passes for a
        waiting or preempted request while others are scheduled; it counts in the
        ``full_sequence_must_fit`` check too, and also when the call needs no new block).
        ``shared_prefix_boundary``: the boundary of the lookup behind ``new_computed_blocks``, kept
        while the request runs under sparse retention (read at admission only); default: the one
        that hit carries when it is ``get_computed_blocks``' result for this request, else 0 (for
        a caller that does not hand the hit back as it was returned, e.g. vLLM's scheduler,
        which keeps the boundary on its request).  ``delay_cache_blocks`` and
        ``full_sequence_must_fit`` are bools (anything else raises, see
        :mod:`kvcore.validation`): flags are typed ``object`` so that both builds refuse a
        non-bool with the same typed error."""
        rid = request.request_id
        tracked = self._requests.get(rid)
        num_computed = request.num_computed_tokens
        hits: Sequence[Sequence[KVCacheBlock]] = self._empty
        # A call that only adds tokens to a running request, or starts a fresh one from nothing,
        # cannot fail validation (`is _ZERO`, identity with the int 0, keeps this cheap: a bool,
        # float, None or numpy zero is not that object; `is False` likewise admits only the
        # bool).  Every other call is validated in full.
        if not (self.fast_path and type(num_new_tokens) is int and num_new_tokens > 0
                and num_new_computed_tokens is _ZERO and num_lookahead_tokens is _ZERO
                and num_external_computed_tokens is _ZERO and num_encoder_tokens is _ZERO
                and reserved_blocks is _ZERO and watermark_blocks is _ZERO
                and full_sequence_must_fit is False and delay_cache_blocks is False
                and (new_computed_blocks is None or new_computed_blocks is self._empty)
                and (not num_computed if tracked is None else
                     tracked[0] is request and num_computed <= tracked[1])):
            # Every other call is checked in full: the counts as ints, then the request's state
            # and the hit (see _check_allocation).
            (num_new_tokens, num_new_computed_tokens, num_lookahead_tokens,
             num_external_computed_tokens, num_encoder_tokens) = check_counts(
                num_new_tokens, num_new_computed_tokens, num_lookahead_tokens,
                num_external_computed_tokens, num_encoder_tokens)
            hits = self._check_allocation(request, num_new_tokens, num_new_computed_tokens,
                                          new_computed_blocks, num_external_computed_tokens)
            if reserved_blocks is not _ZERO:
                reserved_blocks = check_count("reserved_blocks", reserved_blocks)
            if watermark_blocks is not _ZERO:
                watermark_blocks = check_count("watermark_blocks", watermark_blocks)
            if full_sequence_must_fit is not False and full_sequence_must_fit is not True:
                check_flag("full_sequence_must_fit", full_sequence_must_fit)
            if delay_cache_blocks is not False and delay_cache_blocks is not True:
                check_flag("delay_cache_blocks", delay_cache_blocks)
        else:  # the counts the fast path found zero, as ints (for mypy and the compiled build)
            num_new_computed_tokens = num_lookahead_tokens = num_external_computed_tokens = 0
            num_encoder_tokens = reserved_blocks = watermark_blocks = 0

        num_local_computed = num_computed + num_new_computed_tokens
        total_computed = num_local_computed + num_external_computed_tokens
        num_computed_after = total_computed + num_new_tokens  # computed once this step ran
        if num_computed_after > self.max_model_len:
            self._too_long(request, total_computed, num_new_tokens)
        if full_sequence_must_fit is True and not self._full_sequence_fits(
                request, hits, num_encoder_tokens, total_computed, num_local_computed,
                watermark_blocks):
            return None
        cache_upto = None  # cache up to the request's real tokens (never draft slots)
        if self.enable_caching and delay_cache_blocks is False:
            # (Inline, not a helper: a call costs ~50 ns of a ~1.5 µs pure-Python decode step.)
            num_tokens = len(request.all_token_ids)
            if ((len(request.block_hashes) + 1) * self.hash_block_size
                    <= num_tokens - self.num_hash_lookahead_tokens):
                self._sync_hashes(request)  # a block filled: hash it before caching
            cache_upto = num_computed_after if num_computed_after < num_tokens else num_tokens
        num_slots = num_computed_after + num_lookahead_tokens
        if num_slots > self.max_model_len:
            num_slots = self.max_model_len
        if tracked is None:
            # Under sparse retention (or shared-prefix checkpoints) the request keeps its
            # lookup's shared-prefix boundary while it runs (given, or carried by the hit: see
            # lookup_boundary).
            boundary = 0
            if shared_prefix_boundary is not None:
                boundary = check_count("shared_prefix_boundary", shared_prefix_boundary)
            elif self._keeps_boundaries:
                boundary = lookup_boundary(hits, request)
            # (Positional, in the coordinator's parameter order: keywords cost ~100 ns a call in
            # pure Python, 2% of a caching-off admission; BENCHMARKS.md 2026-11-27, issue 37.)
            new_blocks = self.coordinator.allocate_new(
                request, num_slots, hits, num_local_computed, num_external_computed_tokens,
                num_encoder_tokens, cache_upto, reserved_blocks + watermark_blocks,
                num_computed_after, boundary if self._keeps_boundaries else 0)
            if new_blocks is None:
                return None
            self._requests[rid] = [request, num_slots]
        else:
            # A step that takes no block and fills none changes nothing but a hybrid model's
            # state releases: answered without allocate_running.  On the common layout (see
            # KVCacheCoordinator.sole_full_attention) here, with the checks allocate_running
            # makes inlined (no coordinator call); on full attention beside Mamba "align"
            # groups by KVCacheCoordinator.steady_step.
            m = self._sole_full_attention
            if (not (reserved_blocks or watermark_blocks or num_encoder_tokens)
                    and ((m is not None
                          and num_slots <= len(m.req_to_blocks[rid]) * m.block_size
                          and (cache_upto is None
                               or cache_upto // m.block_size <= m.num_cached_block.get(rid, 0)))
                         or (self._steady_steps
                             and self.coordinator.steady_step(request, num_slots,
                                                              num_computed_after,
                                                              total_computed, cache_upto)))):
                if num_slots > tracked[1]:
                    tracked[1] = num_slots
                return self._empty
            new_blocks = self.coordinator.allocate_running(  # (positional: as allocate_new)
                request, num_slots, total_computed, num_encoder_tokens, cache_upto,
                reserved_blocks + watermark_blocks, num_computed_after)
            if new_blocks is None:
                return None
            if num_slots > tracked[1]:
                tracked[1] = num_slots
        if new_blocks is self.coordinator.no_blocks or not any(new_blocks):
            return self._empty
        return KVCacheBlocks(new_blocks)

    def _full_sequence_fits(self, request: RequestLike, hits: Sequence[Sequence[KVCacheBlock]],
                            num_encoder_tokens: int, total_computed: int, local_computed: int,
                            watermark_blocks: int) -> bool:
        """Whether the pool holds the blocks of the request's whole sequence (per group at most
        its admission cap) plus ``watermark_blocks`` (``full_sequence_must_fit``)."""
        full = min(request.num_tokens, self.max_model_len)
        need = self.coordinator.num_blocks_to_allocate(
            request.request_id, full, hits, num_encoder_tokens, total_computed,
            self._admission_caps, full, max(request.num_prompt_tokens, request.num_tokens - 1),
            num_local_computed_tokens=local_computed)
        return need + watermark_blocks <= self.pool.num_free_blocks

    # retain: object, not bool: the compiled build would raise TypeError on entry for a non-bool
    # instead of the InvalidArgumentError below.
    def free(self, request: RequestLike, *, retain: object = False) -> None:
        """Release every block of the request, tail first, so its prefix is evicted last.

        ``retain`` is a retention hint (the caller expects the prefix back, e.g. the next turn of
        a conversation): the request's cached blocks are recorded as accessed once more before
        they are freed (``BlockPool.retain``), so a policy that tells reused blocks from
        one-time ones keeps them as reused (``slru``: protected, ``s3fifo``: main, ``arc``:
        T2); ``lru`` orders by recency only and ignores it.
        """
        if retain is not False:
            retain = check_flag("retain", retain)
        rid = request.request_id
        tracked = self._requests.get(rid)
        if tracked is None or tracked[0] is not request:
            self._tracked(request)  # raises, saying which
        if retain and self.enable_caching:
            self.pool.retain([b for blocks in self.coordinator.get_blocks(rid) for b in blocks])
        if self._reads_releases:
            self._note_release(request)
        self.coordinator.free(rid)
        del self._requests[rid]

    def _note_release(self, request: RequestLike) -> None:
        """Tell a policy that reads releases which blocks the request is about to give up."""
        num_prompt = request.num_prompt_tokens
        num_output = request.num_tokens - num_prompt  # (not max(): a generic call per release)
        # (The policy directly: BlockPool.note_release with trusted=True only forwards, and
        # its keyword call is a frame per release in the pure build.)
        self.pool.policy.on_release(self.coordinator.get_blocks(request.request_id), Release(
            num_prompt, num_output if num_output > 0 else 0, self._block_sizes))

    def pop_blocks_for_free(self, request: RequestLike) -> list[KVCacheBlock]:
        """Deferred free: forget the request and hand back its blocks — every group's, group
        after group, each in allocation order, null positions left out — still referenced.

        Until :meth:`free_withheld` returns them the blocks are neither free (not counted by
        ``num_free_blocks``, so allocations and preemption see them as used) nor reusable, and
        a prefix hit can still share them.  For an engine whose in-flight step may still write
        a finished request's blocks (vLLM's P/D decode instances and KV offloading with async
        scheduling); :meth:`free` is the immediate form."""
        rid = request.request_id
        tracked = self._requests.get(rid)
        if tracked is None or tracked[0] is not request:
            self._tracked(request)  # raises, saying which
        if self._reads_releases:
            self._note_release(request)
        blocks = self.coordinator.pop_blocks(rid)
        del self._requests[rid]
        withheld = self._withheld
        for block in blocks:
            bid = block.block_id
            withheld[bid] = withheld.get(bid, 0) + 1
        return blocks

    def _own_blocks(self, what: str, blocks: Iterable[object]) -> list[KVCacheBlock]:
        """The non-null blocks of ``blocks``, each one of this pool's, or
        :class:`~kvcore.errors.BlockStateError` naming the first that is not (anything, not
        only blocks: ``object``, as the compiled build would raise its own ``TypeError`` for a
        list typed by its elements); :class:`~kvcore.errors.InvalidArgumentError` if ``blocks``
        is not a collection (a single block, ``None``)."""
        mine = self.pool.blocks
        out: list[KVCacheBlock] = []
        for block in check_collection(f"{what}'s blocks", blocks):
            if isinstance(block, KVCacheBlock):
                if block.is_null:
                    continue
                bid = block.block_id
                if 0 <= bid < len(mine) and mine[bid] is block:
                    out.append(block)
                    continue
            raise BlockStateError(f"{what}: {block!r} is not a block of this pool")
        return out

    def withhold(self, blocks: Iterable[object]) -> None:
        """Take one reference on each block for a holder outside the manager — a KV connector
        copying it to or from another tier, as vLLM's ``SimpleCPUOffloadConnector`` does with
        vLLM's ``block_pool.touch`` — withheld like :meth:`pop_blocks_for_free`'s until
        :meth:`free_withheld` returns it.  A block may be in use by requests or free and
        cached; a free one leaves the free side without counting as an access (the eviction
        policy's history is unchanged: ``BlockPool.pin``).  A block listed twice takes two
        references.  Null blocks are skipped.

        Raises :class:`~kvcore.errors.BlockStateError`, changing nothing, for a block of
        another pool and for a free block that caches nothing (no holder and no prefix: it
        holds no KV a caller could want, and taking it would only hide it from allocation).
        """
        batch = self._own_blocks("withhold", blocks)
        for block in batch:
            if block.ref_cnt == 0 and block.block_hash is None:
                raise BlockStateError(f"withhold: block {block.block_id} is free and caches "
                                      "nothing (in use by nobody)")
        self.pool.pin(batch)
        withheld = self._withheld
        for block in batch:
            bid = block.block_id
            withheld[bid] = withheld.get(bid, 0) + 1

    def free_withheld(self, ordered_blocks: Iterable[object]) -> None:
        """Return blocks :meth:`pop_blocks_for_free` handed out, in eviction priority order
        (first = evicted first: pass a request's blocks reversed, so its prefix is evicted
        last).  Null blocks are skipped.  A block returned more often than it was withheld, or
        one of another pool, raises :class:`~kvcore.errors.BlockStateError` and changes
        nothing."""
        blocks = self._own_blocks("free_withheld", ordered_blocks)
        counts: dict[int, int] = {}
        for block in blocks:
            bid = block.block_id
            counts[bid] = n = counts.get(bid, 0) + 1
            if n > self._withheld.get(bid, 0):
                raise BlockStateError(
                    f"free_withheld: block {bid} returned {n} time(s) but withheld "
                    f"{self._withheld.get(bid, 0)} (returned twice, or never withheld)")
        withheld = self._withheld
        for bid, n in counts.items():
            left = withheld[bid] - n
            if left:
                withheld[bid] = left
            else:
                del withheld[bid]
        self.pool.free_blocks(blocks)

    def withhold_new_blocks(self, num_blocks: SupportsIndex) -> list[KVCacheBlock]:
        """Take ``num_blocks`` blocks from the free side for a holder outside the manager (vLLM's
        ``block_pool.get_new_blocks``: the destination of a block copy, a connector's staging
        block), each with one reference withheld like :meth:`pop_blocks_for_free`'s until
        :meth:`free_withheld` returns it.  The blocks are the pool's allocation victims: a
        cached one is evicted (``BlockRemoved``), as any allocation does.

        Raises :class:`~kvcore.errors.NoFreeBlocksError` if fewer blocks are free, and
        :class:`~kvcore.errors.InvalidArgumentError` for a count that is not an int >= 0; either
        way nothing changes."""
        n = check_count("num_blocks", num_blocks)
        if n > self.pool.num_free_blocks:
            raise NoFreeBlocksError(f"withhold_new_blocks: {n} blocks asked for, only "
                                    f"{self.pool.num_free_blocks} are free")
        blocks = self.pool.get_new_blocks(n)
        withheld = self._withheld
        for block in blocks:
            bid = block.block_id
            withheld[bid] = withheld.get(bid, 0) + 1
        return blocks

    def take_block_copies(self) -> tuple[list[tuple[KVCacheBlock, KVCacheBlock]],
                                         list[KVCacheBlock]]:
        """Drain every group's pending block copies (``SingleTypeKVCacheManager.pending_copies``:
        ``(source, destination)`` pairs a copy-on-write recorded, group after group, each in the
        order recorded) and return them with their retained endpoints (``[source, destination]``
        of each pair, in order).

        Each endpoint of a pending copy holds one withheld reference (a copy-on-write withholds
        them when it records the pair; a holder that records a copy itself withholds them with
        :meth:`withhold` or :meth:`withhold_new_blocks`), so neither can be reused before the
        copy has run: the caller returns the retained endpoints with :meth:`free_withheld` once
        the step that runs the copies has been processed (vLLM's scheduler does, through its
        deferred frees).  A pair that is not two of this pool's blocks, or endpoints listed more
        often than they are withheld, raise :class:`~kvcore.errors.BlockStateError` and change
        nothing (the pending lists stay as they are)."""
        managers = self.coordinator.managers
        if not any(m.pending_copies for m in managers):
            return [], []
        pairs: list[tuple[KVCacheBlock, KVCacheBlock]] = []
        counts: dict[int, int] = {}
        mine = self.pool.blocks
        for m in managers:
            # Entries as objects: an outside holder may have appended anything (the compiled
            # build would otherwise raise its own TypeError on a wrong entry).
            entries: list[object] = list(m.pending_copies)
            for pair in entries:
                ends = tuple(pair) if isinstance(pair, (tuple, list)) else ()
                if len(ends) != 2 or not all(
                        isinstance(b, KVCacheBlock) and not b.is_null
                        and 0 <= b.block_id < len(mine) and mine[b.block_id] is b for b in ends):
                    raise BlockStateError(f"pending copy {pair!r} of group {m.group_id} is not "
                                          "a (source, destination) pair of this pool's blocks")
                src, dst = ends
                for block in ends:
                    counts[block.block_id] = n = counts.get(block.block_id, 0) + 1
                    if n > self._withheld.get(block.block_id, 0):
                        raise BlockStateError(
                            f"pending copy {pair!r} of group {m.group_id}: block "
                            f"{block.block_id} retained by {n} pending copies but withheld "
                            f"{self._withheld.get(block.block_id, 0)} time(s)")
                pairs.append((src, dst))
        for m in managers:
            m.pending_copies.clear()
        return pairs, [b for pair in pairs for b in pair]

    @property
    def num_withheld_blocks(self) -> int:
        """References handed out by :meth:`pop_blocks_for_free` and not returned yet."""
        return sum(self._withheld.values())

    def withheld_blocks(self) -> dict[int, int]:
        """Withheld references per block id (a copy)."""
        return dict(self._withheld)

    def set_num_free_blocks(self, num_free_blocks: SupportsIndex) -> None:
        """Hold free blocks back from allocation, or give held ones back, until exactly
        ``num_free_blocks`` blocks are free: a pool short of blocks on demand, for tests and
        drills (vLLM's scheduler tests exhaust its pool by setting its free queue's count).

        Held blocks leave the free side as they are (``BlockPool.pin``: their prefix-cache
        entries stay, no access is recorded, nothing is evicted), those reused last first, so
        later allocations take the blocks they would have taken anyway.  While held they count
        as in use: ``num_free_blocks`` and ``usage`` leave them out, ``reset_prefix_cache``
        refuses, and a hit on one shares it.  Blocks freed meanwhile are free as usual (the
        count rises).  Given back (a larger count), they return to the free side as freed
        blocks do, those that were to be reused first first; ``set_num_free_blocks`` of the
        free and held blocks together gives every held block back.

        A count above the free and held blocks together raises
        :class:`~kvcore.errors.NoFreeBlocksError`, a negative or non-int one
        :class:`~kvcore.errors.InvalidArgumentError`; both change nothing.  Costs one walk of
        the free side when holding (not for hot paths)."""
        n = check_count("num_free_blocks", num_free_blocks)
        pool = self.pool
        free = pool.num_free_blocks
        held = self._held_free
        if n > free + len(held):
            raise NoFreeBlocksError(f"set_num_free_blocks({n}): only {free} blocks are free and "
                                    f"{len(held)} held back ({free + len(held)} in all)")
        if n < free:
            # The free side in reuse order (the policy's, then the hint reserve's): hold its end.
            order = [*pool.policy, *pool.reserve]
            take = order[n:]
            pool.pin(take)
            held[:0] = take  # (ahead of the blocks held earlier, which were reused later)
        elif n > free:
            give = held[:n - free]
            del held[:n - free]
            pool.free_blocks(give)

    @property
    def num_held_free_blocks(self) -> int:
        """Free blocks :meth:`set_num_free_blocks` holds back."""
        return len(self._held_free)

    def held_free_blocks(self) -> list[KVCacheBlock]:
        """The blocks :meth:`set_num_free_blocks` holds back, the first given back first (a
        copy)."""
        return list(self._held_free)

    def cache_blocks(self, request: KVRequest, num_computed_tokens: SupportsIndex) -> None:
        """Cache the request's blocks that are full within its first ``num_computed_tokens``
        tokens (e.g. after a delayed KV transfer completed)."""
        n = check_count("num_computed_tokens", num_computed_tokens)
        self._check_slots(self._tracked(request), n)
        if self.enable_caching:
            self._sync_hashes(request)
            self.coordinator.cache_blocks(request, min(n, request.num_tokens))

    def uncache_blocks(self, request: KVRequest, num_computed_tokens: SupportsIndex) -> None:
        """Drop from the prefix cache the request's blocks that hold any token at or after
        ``num_computed_tokens``: their KV was never written (the step that was to compute them
        failed).  Reference counts and block tables are unchanged; the blocks are cached again
        once their tokens are recomputed."""
        n = check_count("num_computed_tokens", num_computed_tokens)
        self._tracked(request)
        self.coordinator.uncache_blocks(request.request_id, n)

    def first_token_in(self, request_id: str, block_ids: Iterable[int]) -> int | None:
        """The first position of the request's tokens whose KV (or state) one of its groups
        holds in one of ``block_ids``, or ``None``: after a KV connector failed to load those
        blocks, the request may count no token from there on as computed.  A group holding no
        token of the request's own (cross attention's encoder output, a circular buffer) answers
        0 for its blocks."""
        self._known(request_id)
        ids = block_ids if isinstance(block_ids, (set, frozenset)) else set(block_ids)
        return self.coordinator.first_token_in(request_id, ids)

    def can_resume(self, request_id: str, num_computed_tokens: SupportsIndex) -> bool:
        """Whether a running request whose tokens from ``num_computed_tokens`` on must be
        computed again (a failed KV load: see :meth:`first_token_in`, then
        :meth:`uncache_blocks`) can go on from there with its tables: every group holds a real
        block wherever the token at that position reads and from there on, and no group keeps
        a state of the request's latest position only (Mamba, circular buffers).  When it
        cannot (a sliding window or chunk released the blocks it would read), free the request
        and start it over: its valid prefix stays cached for its re-admission."""
        n = check_count("num_computed_tokens", num_computed_tokens)
        self._known(request_id)
        self._check_slots(self._requests[request_id], n)
        return self.coordinator.can_resume(request_id, n)

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: SupportsIndex) -> None:
        """Release the request's blocks that left the attention window at ``num_computed_tokens``
        (``allocate_slots`` does this itself when it succeeds)."""
        n = check_count("num_computed_tokens", num_computed_tokens)
        self._known(request_id)
        self._check_slots(self._requests[request_id], n)
        self.coordinator.remove_skipped_blocks(request_id, n)

    def new_step(self) -> None:
        """Mark a scheduling step boundary (Mamba states cached last step become hittable)."""
        self.coordinator.new_step()

    # -- queries --------------------------------------------------------------------------------
    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        self._known(request_id)
        return KVCacheBlocks(self.coordinator.get_blocks(request_id))

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """The request's block ids, one list per group."""
        self._known(request_id)
        return tuple([b.block_id for b in blocks] for blocks in self.coordinator.get_blocks(request_id))

    def get_partial_block_ids(self, request_id: str, num_tokens: SupportsIndex) -> list[int]:
        """Per group, the id of the block holding token ``num_tokens`` when that token is not
        the first of its block (the partly filled block a step starting there completes);
        groups where it is the first, or the block is null or not allocated, give none."""
        n = check_count("num_tokens", num_tokens)
        self._known(request_id)
        return self.coordinator.partial_block_ids(request_id, n)

    def get_num_common_prefix_blocks(self, request_id: str) -> list[int]:
        """Per group, how many leading blocks of this request every running request shares
        (the cascade-attention prefix)."""
        self._known(request_id)
        return self.coordinator.common_prefix_blocks(request_id, len(self._requests))

    @property
    def usage(self) -> float:
        return self.pool.usage

    @property
    def admission_caps(self) -> tuple[int | None, ...]:
        """Per group, the most blocks ``full_sequence_must_fit`` counts for one request (types
        that recycle blocks within a window), ``None`` where uncapped."""
        return self._admission_caps

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def reset_prefix_cache(self) -> bool:
        """Drop the whole prefix cache; refuses (``False``) while any request holds blocks."""
        if not self.coordinator.reset_prefix_cache():
            return False
        if self.prefix_cache_stats is not None:
            self.prefix_cache_stats.reset = True
        return True

    def declare_upcoming(self, requests: Iterable[KVRequest]) -> None:
        """Declare the requests a scheduler is about to run, most urgent first (replacing the
        previous declaration; an empty iterable clears it).

        Free cached blocks that serve their prefixes are then reused only after every other
        free block (a soft pin: still reused before an allocation would fail), whatever the
        eviction policy.  Hints change eviction order only, never a result of
        ``get_computed_blocks`` or whether ``allocate_slots`` succeeds.
        """
        if isinstance(requests, (str, bytes)) or not isinstance(requests, Iterable):
            raise InvalidArgumentError(f"requests must be an iterable of requests, got "
                                       f"{requests!r:.80}")
        hashes: list[Sequence[BlockHash]] = []
        for request in requests:
            if not isinstance(getattr(request, "block_hashes", None), Sequence):
                raise InvalidArgumentError(f"declare_upcoming takes requests, got {request!r:.80}")
            if self.enable_caching and not request.skip_reading_prefix_cache:
                hashes.append(request.block_hashes)
        self.pool.set_hints(self.coordinator.hint_hashes(hashes))

    @property
    def retained_hit_groups(self) -> frozenset[int]:
        """The groups whose lookups keep their longer hit (:meth:`retain_longer_hits`)."""
        return self.coordinator.retained_hit_groups

    def retain_longer_hits(self, group_ids: Iterable[int]) -> None:
        """Let these groups keep their own longer hit (vLLM's ``retains_longer_hit``, for a KV
        connector that loads the other groups' KV but not theirs): ``get_computed_blocks``
        returns a retained full-attention group's hit blocks beyond the hit length all groups
        agree on, and ``allocate_slots`` keeps as many of a retained group's hit blocks as the
        local and external computed tokens cover (``cdiv(num_new_computed_tokens +
        num_external_computed_tokens, block_size)``), so those blocks stand for the external
        tokens in that group instead of fresh ones.  Replaces the previous set; an id that is
        not a group raises :class:`InvalidGroupError` and changes nothing."""
        # (elements as objects: the compiled build would turn a bool into an int on the way)
        raw: list[object] = list(check_collection("group_ids", group_ids))
        ids: list[int] = []
        for g in raw:
            if type(g) is not int or not 0 <= g < self.num_groups:
                raise InvalidGroupError(f"retain_longer_hits: {g!r} is not a group id (0 to "
                                        f"{self.num_groups - 1})")
            ids.append(g)
        self.coordinator.retained_hit_groups = frozenset(ids)
        # Lookups and allocations answer differently now: a caller remembering them (the vLLM
        # adapter's retry memo) must ask again (BlockPool's cache_version).
        self.pool.cache_version += 1

    def _trim_retained(self, hits: Sequence[Sequence[KVCacheBlock]], num_reused: int
                       ) -> Sequence[Sequence[KVCacheBlock]]:
        """``hits`` with each retained group's blocks cut to the ``num_reused`` tokens the
        allocation adopts (the same object when none is longer)."""
        out = None
        for g in self.coordinator.retained_hit_groups:
            keep = -(-num_reused // self.coordinator.managers[g].block_size)
            blocks = hits[g]
            if isinstance(blocks, (list, tuple)) and len(blocks) > keep:
                if out is None:
                    out = list(hits)
                out[g] = blocks[:keep]
        return hits if out is None else tuple(out)

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        """Drop these blocks from the prefix cache (reference counts unchanged)."""
        self.pool.evict_blocks(block_ids)

    def take_events(self) -> list[KVCacheEvent]:
        """The KV events recorded since the last call (``BlockStored`` events carry their
        group's spec kind and sliding window, as vLLM publishes them)."""
        return self.pool.take_events()

    def make_prefix_cache_stats(self) -> PrefixCacheStats | None:
        """The stats collected since the last call (and start a new interval); ``None`` when
        ``log_stats`` is off."""
        if self.prefix_cache_stats is None:
            return None
        stats = self.prefix_cache_stats
        self.prefix_cache_stats = PrefixCacheStats()
        return stats

    def check_invariants(self) -> None:
        """Raise :class:`~kvcore.errors.InvariantError` if any pool or manager invariant fails."""
        from kvcore.invariants import check_manager_invariants

        check_manager_invariants(self)

    def requests(self) -> dict[str, KVRequest]:
        """The requests holding blocks, by id (a copy)."""
        return {rid: t[0] for rid, t in self._requests.items()}

    def num_slots(self, request_id: str) -> int:
        """How many tokens the request has slots for (computed tokens never exceed it)."""
        self._known(request_id)
        return int(self._requests[request_id][1])

    # -- input checks: is this call one the manager may serve now?  Each raises kvcore's typed
    # error naming the value before anything changes; called off the fast path only.

    def _sync_hashes(self, request: RequestLike) -> None:
        # Requests built without this manager's hasher get their missing hashes here.
        hashes = request.block_hashes
        if len(hashes) < num_hashable_blocks(len(request.all_token_ids), self.hash_block_size,
                                             self.num_hash_lookahead_tokens):
            hashes.extend(self.block_hasher(request))

    def _check_allocation(self, request: RequestLike, num_new_tokens: int,
                          num_new_computed_tokens: int, new_computed_blocks: object,
                          num_external_computed_tokens: int) -> Sequence[Sequence[KVCacheBlock]]:
        """Raise unless ``allocate_slots`` may serve these (non-negative) counts for ``request``
        in its current state; returns the hit blocks per group."""
        rid = request.request_id
        running = rid in self._requests
        if running or request.num_computed_tokens:
            self._check_request(request)  # raises for a stranger, a freed or overrun request
        if num_new_tokens == 0 and num_new_computed_tokens == 0 and num_external_computed_tokens == 0:
            raise InvalidArgumentError("allocate_slots needs new tokens or computed tokens to adopt")
        hits = self._empty if new_computed_blocks is None else new_computed_blocks
        if not isinstance(hits, (tuple, list)) or len(hits) != self.num_groups:
            raise InvalidArgumentError(
                f"new_computed_blocks must hold one block list per group ({self.num_groups}), "
                f"got {new_computed_blocks!r}")
        has_hits = any(hits)
        if not has_hits and hits is not self._empty:
            self._check_groups(hits)  # (a hit with blocks is checked by _check_hits)
        if running:
            if has_hits or num_new_computed_tokens:
                raise RequestStateError(f"request {rid!r} is running: it cannot take a new "
                                        "prefix hit")
            return hits
        if num_new_computed_tokens + num_external_computed_tokens > request.num_tokens:
            raise InvalidHitError(
                f"request {rid!r}: {num_new_computed_tokens} hit + {num_external_computed_tokens} "
                f"external tokens exceed its {request.num_tokens} tokens")
        if has_hits or num_new_computed_tokens:
            if self.coordinator.retained_hit_groups:
                hits = self._trim_retained(hits, num_new_computed_tokens
                                           + num_external_computed_tokens)
            look = hits.lookup if type(hits) is LookupHit else None
            pool = self.pool
            if (look is None or look[0] is not request or look[1] != num_new_computed_tokens
                    or look[2] != pool.num_evicted_blocks
                    or look[3] != pool.num_invalidations):
                self._check_hits(request, hits, num_new_computed_tokens,
                                 num_external_computed_tokens)
        return hits

    def _check_groups(self, hits: Sequence[object]) -> None:
        """Raise :class:`InvalidHitError` unless each group of ``hits`` is a list or a tuple."""
        for g, blocks in enumerate(hits):
            if not isinstance(blocks, (tuple, list)):
                raise InvalidHitError(f"new_computed_blocks must hold a list or tuple of blocks "
                                      f"per group, got {blocks!r:.80} for group {g}")

    def _check_request(self, request: RequestLike) -> bool:
        """Whether ``request`` is running; raises if another object holds its id, if it claims
        tokens computed beyond its slots, or if it is not running but claims computed tokens
        (freed, finished, or never admitted)."""
        rid = request.request_id
        tracked = self._requests.get(rid)
        if tracked is None:
            if request.num_computed_tokens:
                raise RequestStateError(
                    f"request {rid!r} has num_computed_tokens={request.num_computed_tokens} but "
                    "holds no blocks: it was freed (finished, or preempted without resetting "
                    "num_computed_tokens to 0) or never admitted")
            return False
        if tracked[0] is not request:
            raise RequestStateError(f"request id {rid!r} is already used by another live request")
        slots = tracked[1]
        if request.num_computed_tokens > slots:
            raise RequestStateError(
                f"request {rid!r} has num_computed_tokens={request.num_computed_tokens} but slots "
                f"for only {slots} tokens: tokens without a slot were never computed")
        return True

    def _check_hits(self, request: KVRequest, hits: Sequence[Sequence[KVCacheBlock]],
                    num_hit_tokens: int, num_external_tokens: int) -> None:
        """Raise :class:`InvalidHitError` unless ``hits`` is a prefix hit of ``num_hit_tokens``
        tokens that this manager could serve the request now: in every group, one block per
        ``block_size`` hit tokens (a state group may hold fewer when external tokens follow:
        their load brings the state), each one of this pool's blocks still cached under the
        request's hash at its position (and, in verify mode, proven to hold the request's own
        prefix), and the null block only where the next token reads no KV."""
        rid = request.request_id
        if not self.enable_caching:
            raise InvalidHitError(f"request {rid!r}: prefix caching is disabled, so "
                                  f"new_computed_blocks / num_new_computed_tokens must be empty")
        self._check_groups(hits)
        self._sync_hashes(request)
        mine = self.pool.blocks
        null = self.pool.null_block
        total_computed = num_hit_tokens + num_external_tokens
        # The loop stays here, not in the coordinator: it is the manager's input check, each
        # failure explained by _bad_hit (and in verify mode by the loop below) in its own terms.
        for g, (m, blocks) in enumerate(zip(self.coordinator.managers, hits)):
            bs = m.block_size
            if not m.enable_caching:
                if blocks:
                    raise InvalidHitError(f"request {rid!r}: group {g} is never cached, but "
                                          f"new_computed_blocks holds {len(blocks)} blocks for it")
                continue
            if m.partial_hits and num_hit_tokens % bs and blocks:
                # A hit ending inside a block: its last block is the one cached under the
                # request's hash at the hit's end (a partial entry), the others as usual.
                self._check_partial_tail(request, hits, g, blocks, num_hit_tokens, bs)
                blocks = blocks[:-1]
                if len(blocks) != num_hit_tokens // bs:
                    raise InvalidHitError(
                        f"request {rid!r}: num_new_computed_tokens={num_hit_tokens} but group "
                        f"{g} has {len(blocks) + 1} hit blocks of {bs} tokens")
            elif len(blocks) * bs != num_hit_tokens and not (
                    # A recurrent state's hit may stop short when a KV connector supplies the
                    # state at the end of the computed tokens (vLLM: a connector that refills
                    # Mamba state behind a deeper full-attention hit).
                    m.spec.holds_state and num_external_tokens
                    and len(blocks) * bs < num_hit_tokens) and not (
                    # A retained group's longer hit stands for external tokens it covers.
                    num_external_tokens and g in self.coordinator.retained_hit_groups
                    and num_hit_tokens < len(blocks) * bs < total_computed + bs):
                raise InvalidHitError(
                    f"request {rid!r}: num_new_computed_tokens={num_hit_tokens} but group {g} "
                    f"has {len(blocks)} hit blocks of {bs} tokens")
            needed_from = m.get_num_unread_tokens(total_computed) // bs
            hashes = hashes_at(request.block_hashes, self.hash_block_size, bs)
            i = 0
            try:  # the common case in one tight pass; _bad_hit explains a failure
                for i, block in enumerate(blocks):
                    if block is null:
                        if i < needed_from:
                            continue
                    elif (block.block_hash == hashes[i] and block.group_id == g
                          and mine[block.block_id] is block):
                        continue
                    self._bad_hit(request, hits, g, i, block, needed_from, hashes)
            except (AttributeError, IndexError, TypeError):
                self._bad_hit(request, hits, g, i, blocks[i], needed_from, hashes)
        if self.verify_hits:
            verifier = HitVerifier(request, self.num_hash_lookahead_tokens)
            for g, (m, blocks) in enumerate(zip(self.coordinator.managers, hits)):
                for i, block in enumerate(blocks):
                    if not block.is_null and not verifier.matches(block.prefix_node, i,
                                                                  m.block_size):
                        raise InvalidHitError(
                            f"request {rid!r}: block {block.block_id} at group {g} position "
                            f"{i} holds KV of another prefix")

    def _check_partial_tail(self, request: KVRequest, hits: Sequence[Sequence[KVCacheBlock]],
                            g: int, blocks: Sequence[KVCacheBlock], num_hit_tokens: int,
                            bs: int) -> None:
        """Raise :class:`InvalidHitError` unless the last of ``blocks`` (group ``g``'s part of a
        hit of ``num_hit_tokens`` tokens, ending inside that block) is this pool's block cached
        under the request's hash at the hit's end, at the hit's last table position."""
        rid = request.request_id
        block = blocks[-1]
        unit = self.hash_block_size
        index = num_hit_tokens // unit - 1
        mine = self.pool.blocks
        if (len(blocks) != -(-num_hit_tokens // bs) or num_hit_tokens % unit
                or index >= len(request.block_hashes)):
            raise InvalidHitError(f"request {rid!r}: num_new_computed_tokens={num_hit_tokens} "
                                  f"but group {g} has {len(blocks)} hit blocks of {bs} tokens")
        key = request.block_hashes[index]
        # Attention: the block holds the hit's prefix if it is cached under the request's hash
        # at the hit's end or at any later unit inside the block (a partial entry, or its full
        # hash: a hit a hybrid search or EAGLE's drop trimmed keeps its first tokens).  A
        # recurrent state is the state after its entry's tokens only: that entry must be the
        # block's own, at the hit's end.
        state = self.coordinator.managers[g].spec.holds_state
        position = len(blocks) - 1
        if (not isinstance(block, KVCacheBlock) or block.is_null
                or not 0 <= block.block_id < len(mine) or mine[block.block_id] is not block):
            self._bad_hit(request, hits, g, position, block, position + 1, [])
        if state:
            held = (block.block_hash == key
                    and self.pool.partial_primary_tokens(block) == num_hit_tokens)
        else:
            keys = set(request.block_hashes[index:min((position + 1) * bs // unit,
                                                      len(request.block_hashes))])
            held = block.block_hash in keys or not keys.isdisjoint(
                self.pool.secondary_keys(block))
        if block.group_id != g or not held:
            if block.block_hash is None or evictions_since_lookup(hits, request, self.pool):
                # (says why: evicted or reused since the lookup, or never cached)
                self._bad_hit(request, hits, g, position, block, position + 1,
                              [None] * position + [key])
            raise InvalidHitError(
                f"request {rid!r}: group {g}'s hit ends inside block {block.block_id}, which "
                f"is not cached under the request's prefix of {num_hit_tokens} tokens")

    def _bad_hit(self, request: KVRequest, hits: Sequence[Sequence[KVCacheBlock]], g: int,
                 i: int, block: object, needed_from: int, hashes: Sequence[object]) -> NoReturn:
        """Raise the :class:`InvalidHitError` that says why ``block`` cannot be hit ``i`` of
        group ``g`` (:class:`StaleHitError` when the request's own lookup found it and it was
        evicted since)."""
        mine = self.pool.blocks
        rid = request.request_id
        where = f"request {rid!r}: group {g} position {i}"
        if block is self.pool.null_block:
            raise InvalidHitError(f"{where} of the hit is the null block, but the next token "
                                  "attends to it")
        if (not isinstance(block, KVCacheBlock) or not 0 <= block.block_id < len(mine)
                or mine[block.block_id] is not block):
            raise InvalidHitError(f"{where}: {block!r} is not a block of this manager's pool")
        other = block.block_hash is not None and (i >= len(hashes) or block.block_hash != hashes[i]
                                                  or block.group_id != g)
        evicted = evictions_since_lookup(hits, request, self.pool)
        if evicted:
            now = ("is cached for a different prefix now" if other else
                   "is no longer cached")
            raise StaleHitError(
                f"{where}: block {block.block_id} {now}: the hit went stale between lookup and "
                "allocation (get_computed_blocks found it for this request, then the pool "
                "evicted it, e.g. for other allocations; allocate right after the lookup, or "
                "look the request up again)")
        if other:
            raise InvalidHitError(f"{where}: block {block.block_id} is cached for a different "
                                  "prefix (the hit blocks belong to another prefix, or the "
                                  "block was reused for one since get_computed_blocks)")
        raise InvalidHitError(f"{where}: block {block.block_id} is no longer cached under the "
                              "request's hash (evicted or reused since get_computed_blocks)")

    def _too_long(self, request: KVRequest, num_computed: int, num_new: int) -> None:
        raise InvalidArgumentError(
            f"request {request.request_id!r}: {num_computed} computed + {num_new} new tokens "
            f"exceed max_model_len={self.max_model_len}")

    def _known(self, request_id: str) -> None:
        if request_id not in self._requests:
            raise UnknownRequestError(f"request {request_id!r} holds no blocks")

    def _tracked(self, request: KVRequest) -> list[Any]:
        """The record of ``request``, which must be the object holding blocks under its id."""
        rid = request.request_id
        tracked = self._requests.get(rid)
        if tracked is None:
            raise UnknownRequestError(f"request {rid!r} holds no blocks (never allocated, or "
                                      "already freed)")
        if tracked[0] is not request:
            raise RequestStateError(f"request id {rid!r} is held by another request object")
        return tracked

    def _check_slots(self, tracked: list[Any], num_tokens: int) -> None:
        if num_tokens > tracked[1]:
            raise RequestStateError(
                f"request {tracked[0].request_id!r} has slots for {tracked[1]} tokens, not "
                f"{num_tokens}")
