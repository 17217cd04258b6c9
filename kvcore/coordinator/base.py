"""KVCacheCoordinator: drives one single-type manager per KV-cache group over one shared pool.

Allocation has two entry points, :meth:`KVCacheCoordinator.allocate_new` (admission) and
:meth:`~KVCacheCoordinator.allocate_running` (growth), the same for one group or many:
count what every group needs (releasing blocks that left the window only counts as freeing
them), then, if the pool can supply it, take every group's hit blocks (phase 1: touch all
groups' hits before any group allocates, so one group's allocation can never evict another
group's not-yet-taken hit), append new blocks to every group (phase 2) and cache the now-full
blocks.  Subclasses decide only how a prefix hit is found and how hits of different groups
combine (``find_longest_cache_hit``).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from typing import ClassVar

from kvcore.block_pool import BlockPool
from kvcore.errors import InvalidGroupError, UnsupportedFeatureError
from kvcore.hashing import hashes_at
from kvcore.managers import make_manager
from kvcore.managers.base import ManagerContext, SingleTypeKVCacheManager, cdiv
from kvcore.managers.full_attention import FullAttentionManager
from kvcore.managers.mamba import MambaAlignManager
from kvcore.request import RequestLike
from kvcore.settings import CacheSettings
from kvcore.specs import KVCacheConfig
from kvcore.types import BlockHash, GroupBlocks, KVCacheBlock, KVRequest, PrefixNode
from kvcore.verify import HitVerifier, PrefixChains


def dropping_groups(config: KVCacheConfig, settings: CacheSettings) -> frozenset[int] | None:
    """The groups whose hits drop their last block under EAGLE (``CacheSettings.use_eagle``
    and ``eagle_groups``): ``None`` for every group, empty without EAGLE.  Groups with equal
    specs are searched together, so a listed group's equals drop too (vLLM propagates the flag
    within a spec group alike).  An id past the model's groups raises
    :class:`~kvcore.errors.InvalidGroupError` naming it."""
    if not settings.use_eagle:
        return frozenset()
    listed = settings.eagle_groups
    if listed is None:
        return None
    n = config.num_groups
    bad = sorted(g for g in listed if g >= n)
    if bad:
        raise InvalidGroupError(f"eagle_groups {bad} name no group of this model (it has {n}: "
                                f"ids 0 to {n - 1})")
    specs = [config.groups[g].spec for g in listed]
    return frozenset(i for i, g in enumerate(config.groups) if g.spec in specs)


def _plain_full_attention(manager: SingleTypeKVCacheManager) -> bool:
    """Whether ``manager`` is kvcore's own full-attention class with no window, encoder,
    padding slots, partial tail or growth of its own: a step whose slots its table already
    holds and that fills no block changes nothing there (the coordinator's decode shortcuts)."""
    return (type(manager) is FullAttentionManager and not manager.extra_slots
            and not manager.caches_partial_tail and not manager.releases_blocks
            and not manager.uses_encoder_tokens and not manager.counts_own_growth)


class KVCacheCoordinator:
    """Base: everything except how a prefix hit is found.

    Built by :func:`~kvcore.coordinator.make_coordinator` over the manager's pool and settings.
    A subclass sets ``aligns_caching`` (hybrid models: groups cache only up to a multiple of
    ``alignment_tokens``, since a hit must end on one; otherwise every full block is cached)
    and builds its own lookup state in ``_prepare``.
    """

    aligns_caching: ClassVar[bool] = False

    def __init__(self, config: KVCacheConfig, pool: BlockPool, settings: CacheSettings) -> None:
        self.config = config
        self.pool = pool
        self.enable_caching = enable_caching = settings.enable_caching
        self.verify_hits = pool.verify_hits
        # EAGLE: the groups whose hits drop their last block (None: all) and whether any does.
        self.eagle_group_ids = eagle_ids = dropping_groups(config, settings)
        self.use_eagle = settings.use_eagle and (eagle_ids is None or bool(eagle_ids))
        self.hash_block_size = config.hash_block_size
        # Partial-block hits (KVCacheConfig.partial_block_hits): hits end on any hash unit and
        # caching is not rounded (vLLM: rounding even to the unit would register a Mamba
        # tail that was copied on write again).
        self.partial_hits = settings.enable_caching and config.partial_block_hits
        if self.partial_hits and self.verify_hits:
            raise UnsupportedFeatureError(
                "partial-block hits (KVCacheConfig.partial_block_hits) with verified hits "
                "(CacheSettings.verify_hits): a partial entry carries no prefix proof")
        # Shared-prefix checkpoints: in effect only with partial hits.
        self.shared_prefix_checkpoint = (settings.mamba_shared_prefix_checkpoint
                                         and self.partial_hits)
        self.alignment_tokens = alignment_tokens = (config.hit_alignment_tokens
                                                   if self.partial_hits
                                                   else config.alignment_tokens)
        self.cache_alignment = (alignment_tokens if self.aligns_caching and not self.partial_hits
                                else None)
        self.prefix_chains = (PrefixChains(settings.num_hash_lookahead_tokens) if self.verify_hits
                              else None)
        ctx = ManagerContext(pool, enable_caching, self.hash_block_size, alignment_tokens,
                             self.use_eagle, self.prefix_chains,
                             config.prefix_cache_retention_interval,
                             eagle_junction_tail=settings.eagle_junction_tail,
                             mamba_recache_prompt_boundary=settings.mamba_recache_prompt_boundary,
                             eagle_group_ids=eagle_ids,
                             partial_block_hits=self.partial_hits,
                             mamba_shared_prefix_checkpoint=self.shared_prefix_checkpoint,
                             scheduler_alignment=config.alignment_tokens)
        # References withheld from the pool by block id (KVCacheManager's deferred frees and
        # block copies; a partial hit's copy-on-write withholds its endpoints here).
        self.withheld = ctx.withheld
        # Per running request, the shared-prefix boundary of its admission lookup (read by
        # sparse-retention caching; written at admission, dropped when the request is freed).
        self.shared_prefix_boundaries = ctx.shared_prefix_boundaries
        self.managers: tuple[SingleTypeKVCacheManager, ...] = tuple(
            make_manager(g.spec, i, ctx, overrides=settings.manager_classes)
            for i, g in enumerate(config.groups))
        # Capabilities, read once: which groups size by encoder tokens, release blocks early,
        # and cache.
        self._encoder = tuple(m.uses_encoder_tokens for m in self.managers)
        self._any_encoder = any(self._encoder)
        self._decoder = tuple(m for m in self.managers if not m.uses_encoder_tokens)
        # Types that count their own growth (Mamba "align") and the decoder types that do not.
        self._own_growth = tuple(m for m in self.managers if m.counts_own_growth)
        self._dense_decoder = tuple(m for m in self._decoder
                                    if not m.counts_own_growth and not m.extra_slots)
        # Decoder types whose tables reach ``extra_slots`` tokens past the slots (Mamba "none"
        # with speculative state blocks): counted apart, so the common loop stays as it is.
        self._padded = tuple(m for m in self._decoder
                             if not m.counts_own_growth and m.extra_slots)
        # What each group is sized by: 0 the slots, 1 the encoder tokens, 2 the main model's.
        self._sizing = tuple(1 if m.uses_encoder_tokens else 2 if m.counts_own_growth else 0
                             for m in self.managers)
        self._releasing = tuple(m for m in self.managers if m.releases_blocks)
        self._caching = tuple(m for m in self.managers if m.enable_caching)
        # Types that may take a partial-block hit (copy-on-write of its shared tail).
        self._fine = tuple(m for m in self.managers if m.partial_hits)
        # What an allocation returns when no group got a block (shared: never mutated).
        self.no_blocks: GroupBlocks = tuple([] for _ in self.managers)
        # A layout of one plain full-attention group (no window, encoder, padding, partial tail
        # or cache alignment, and kvcore's own class): a decode step whose slots its blocks
        # already hold and that fills no block changes nothing there, and
        # KVCacheManager.allocate_slots answers it without calling allocate_running.
        full = tuple(m for m in self.managers if _plain_full_attention(m))
        self.sole_full_attention: SingleTypeKVCacheManager | None = (
            full[0] if len(self.managers) == 1 and full and self.cache_alignment is None
            else None)
        # A hybrid layout of plain full-attention groups (as above, cache alignment allowed) and
        # Mamba "align" state groups (kvcore's own classes; no speculative state blocks,
        # partial-block hits, EAGLE or hit verification): a running request's step that takes
        # no block and fills none changes nothing there but the state groups' releases and
        # per-step marks, and KVCacheManager.allocate_slots has steady_step answer it without
        # calling allocate_running.
        state = tuple(m for m in self.managers if type(m) is MambaAlignManager
                      and not m.num_speculative_blocks and not m.partial_hits)
        steady = (bool(state) and len(full) + len(state) == len(self.managers)
                  and not self.use_eagle and not self.partial_hits and not self.verify_hits)
        self._steady_full: tuple[SingleTypeKVCacheManager, ...] = full if steady else ()
        self._steady_state: tuple[MambaAlignManager, ...] = state if steady else ()
        self.steady_steps = steady
        # Groups whose lookup keeps their own longer hit rather than the hit all groups agree
        # on (vLLM's retains_longer_hit; KVCacheManager.retain_longer_hits sets them).
        self.retained_hit_groups: frozenset[int] = frozenset()
        self._prepare()

    def _prepare(self) -> None:
        """Build the subclass's lookup state from ``managers`` (called once, last in
        ``__init__``)."""

    # -- hits -------------------------------------------------------------------------------------
    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash], max_length: int,
                               verifier: HitVerifier | None) -> tuple[GroupBlocks, int, int]:
        """Per-group hit blocks, the hit length in tokens (at most ``max_length``) and the
        shared-prefix boundary (hybrid: the longest hit a group found, when longer than the hit
        all groups agree on; else 0).  A lookup changes no state."""
        raise NotImplementedError

    # -- allocation -------------------------------------------------------------------------------
    def num_blocks_to_allocate(self, request_id: str, num_tokens: int,
                               hits: Sequence[Sequence[KVCacheBlock]], num_encoder_tokens: int,
                               total_computed_tokens: int,
                               max_blocks: Sequence[int | None] | None = None,
                               num_main_tokens: int | None = None, prefill_end: int = 0,
                               record: bool = False,
                               num_local_computed_tokens: int | None = None) -> int:
        """Free blocks all groups need together to hold ``num_tokens`` tokens (encoder groups:
        ``num_encoder_tokens``; types counting their own growth: ``num_main_tokens``, default
        ``num_tokens``, with ``prefill_end`` and ``record``, see ``count_state_blocks``), hit
        blocks that leave the free queue included; ``max_blocks`` caps each group's
        per-request holding (admission of the whole sequence)."""
        n = 0
        for i, m in enumerate(self.managers):
            sizing = self._sizing[i]
            if sizing == 2:
                n += m.count_state_blocks(
                    request_id, num_tokens if num_main_tokens is None else num_main_tokens,
                    hits[i], total_computed_tokens, prefill_end, record)
                continue
            n += m.get_num_blocks_to_allocate(
                request_id, num_encoder_tokens if sizing == 1 else num_tokens, hits[i],
                total_computed_tokens, None if max_blocks is None else max_blocks[i])
        if self._fine:
            # A local hit ending inside a block takes one more: its shared tail's copy (vLLM
            # counts the local hit's tokens, not the external ones after it).
            local = (total_computed_tokens if num_local_computed_tokens is None
                     else num_local_computed_tokens)
            for m in self._fine:
                n += m.cow_blocks(request_id, hits[m.group_id], local)
        return n

    def allocate_new(self, request: RequestLike, num_slots: int,
                     hits: Sequence[Sequence[KVCacheBlock]], num_local_computed_tokens: int,
                     num_external_computed_tokens: int, num_encoder_tokens: int,
                     num_tokens_to_cache: int | None, reserved_blocks: int = 0,
                     num_main_tokens: int | None = None,
                     shared_prefix_boundary: int = 0) -> GroupBlocks | None:
        """Admit ``request``: give it slots for ``num_slots`` tokens in every group, or return
        ``None`` having changed nothing.

        The request starts with its prefix hit ``hits`` (one block list per group, covering
        ``num_local_computed_tokens``) plus fresh blocks for ``num_external_computed_tokens``
        computed elsewhere, or from nothing when both are 0.  Then every group grows to
        ``num_slots`` tokens (encoder groups: ``num_encoder_tokens``) and caches (see
        :meth:`_grow_and_cache`).  ``reserved_blocks`` free blocks must stay free afterwards.
        Types that count their own growth (``counts_own_growth``) are sized by
        ``num_main_tokens`` (the main model's tokens, default ``num_slots``) and asked for their
        count on every call.  A non-zero ``shared_prefix_boundary`` (sparse retention) is kept
        for the request until it is freed: its groups cache the blocks before it.  Returns the
        new blocks per group.
        """
        rid = request.request_id
        total_computed = num_local_computed_tokens + num_external_computed_tokens
        own = self._own_growth
        main = num_slots if num_main_tokens is None else num_main_tokens
        prefill_end = 0
        if own:
            prefill_end = max(request.num_prompt_tokens, len(request.all_token_ids) - 1)
        if total_computed:
            # A new request bringing computed tokens: each type counts and takes its own hits.
            need = self.num_blocks_to_allocate(rid, num_slots, hits, num_encoder_tokens,
                                               total_computed, None, main, prefill_end, True,
                                               num_local_computed_tokens)
            if need > self.pool.num_free_blocks - reserved_blocks:
                return None
            if own and num_external_computed_tokens:
                # Blocks a type's count leaves out but its allocation takes (vLLM's count
                # decides; these must exist too, or vLLM's allocation fails midway).
                short = 0
                for m in own:
                    short += m.shortfall
                if short and need + short > self.pool.num_free_blocks:
                    return None
            # Phase 1: every group takes its hit before any group allocates.
            for i, m in enumerate(self.managers):
                m.add_computed_blocks(rid, hits[i], total_computed)
            for m in self._fine:
                m.note_partial_hit(rid, hits[m.group_id], num_local_computed_tokens,
                                   total_computed)
            if num_external_computed_tokens:
                for m in self._decoder:
                    m.allocate_external_computed_blocks(rid, num_local_computed_tokens,
                                                        num_external_computed_tokens)
            if self.prefix_chains is not None and num_local_computed_tokens:
                self._adopt_chains(rid, hits)
        else:
            # A new request starting from nothing: one fresh table per group.
            need = 0
            for m, sizing in zip(self.managers, self._sizing):
                if sizing == 2:
                    need += m.count_state_blocks(rid, main, (), 0, prefill_end, True)
                else:
                    # (cdiv inlined, as in allocate_running: once per group per admission)
                    need += -(-(num_encoder_tokens if sizing else num_slots + m.extra_slots)
                              // m.block_size)
            if need > self.pool.num_free_blocks - reserved_blocks:
                return None
        if shared_prefix_boundary:  # (read when caching: set once the allocation cannot fail)
            self.shared_prefix_boundaries[rid] = shared_prefix_boundary
        return self._grow_and_cache(request, need, num_slots, num_encoder_tokens, main,
                                    num_tokens_to_cache)

    def allocate_running(self, request: RequestLike, num_slots: int,
                         num_computed_tokens: int, num_encoder_tokens: int,
                         num_tokens_to_cache: int | None, reserved_blocks: int = 0,
                         num_main_tokens: int | None = None) -> GroupBlocks | None:
        """Grow running ``request`` to ``num_slots`` tokens in every group, or return ``None``
        having changed nothing.

        First the blocks that left its attention window (up to its ``num_computed_tokens`` not
        in flight) are released, then every group grows and caches as in
        :meth:`allocate_new`.  ``reserved_blocks`` free blocks must stay free afterwards (also
        for a call that takes no block, as vLLM checks it).  This runs every decode step.
        """
        rid = request.request_id
        own = self._own_growth
        main = num_slots if num_main_tokens is None else num_main_tokens
        prefill_end = 0
        if own:
            prefill_end = max(request.num_prompt_tokens, len(request.all_token_ids) - 1)
        # Growth only.  The count is inlined, cdiv included, not get_num_blocks_to_allocate:
        # each call costs ~40 ns per group per decode step in pure Python (timeit, Python 3.11:
        # cdiv(a, b) 76 ns against -(-a // b) 38 ns; a pure decode step is ~1.5 µs).  The
        # free count is read only where it is compared: a decode step that needs no new block
        # never reads it.
        need = 0
        for m in self._dense_decoder:
            n = -(-num_slots // m.block_size) - len(m.req_to_blocks[rid])
            if n > 0:
                need += n
        for m in self._padded:
            n = -(-(num_slots + m.extra_slots) // m.block_size) - len(m.req_to_blocks[rid])
            if n > 0:
                need += n
        for m in own:
            need += m.count_state_blocks(rid, main, (), num_computed_tokens, prefill_end, True)
        if num_encoder_tokens and self._any_encoder:
            # Encoder groups grow to num_encoder_tokens whenever it is passed (vLLM's
            # scheduler passes it only with the encoder input, at admission).
            for m, sized_by_encoder in zip(self.managers, self._encoder):
                if sized_by_encoder:
                    n = cdiv(num_encoder_tokens, m.block_size) - len(m.req_to_blocks.get(rid, ()))
                    if n > 0:
                        need += n
        if self._releasing:
            # Blocks leave the window on the processed tokens only: a step in flight still
            # reads below its optimistic boundary (and rejected drafts can roll it back).
            processed = num_computed_tokens - request.num_in_flight_tokens
            if processed < 0:
                processed = 0
            if (need or reserved_blocks) and need > self.pool.num_free_blocks - reserved_blocks:
                # Blocks that left the window count as free: they are released first.
                available = self.pool.num_free_blocks - reserved_blocks
                freeable = 0
                for m in self._releasing:
                    freeable += m.get_num_freeable_skipped_blocks(rid, processed)
                if need > available + freeable:
                    return None
            for m in self._releasing:  # phase 1: release what left the window
                m.remove_skipped_blocks(rid, processed)
        elif (need or reserved_blocks) and need > self.pool.num_free_blocks - reserved_blocks:
            return None
        return self._grow_and_cache(request, need, num_slots, num_encoder_tokens, main,
                                    num_tokens_to_cache)

    def steady_step(self, request: RequestLike, num_slots: int, num_main_tokens: int,
                    num_computed_tokens: int, num_tokens_to_cache: int | None) -> bool:
        """A running request's step on the ``steady_steps`` layout, answered without
        :meth:`allocate_running` when it takes no block and fills none: every full-attention
        group's table already holds ``num_slots`` slots and caches nothing new within
        ``num_tokens_to_cache`` (aligned down as :meth:`cache_blocks` aligns it), every state
        group's holds ``num_main_tokens`` and caches nothing new either.  Then the state groups
        release what the processed tokens left behind and keep their per-step marks, as
        ``allocate_running`` would with no block needed and none reserved, and this returns
        ``True``; otherwise it returns ``False`` having changed nothing (the caller takes the
        general path).  ``tests/test_steady_step.py`` holds it to the general path's answers."""
        rid = request.request_id
        n = num_tokens_to_cache
        align = self.cache_alignment
        if n is not None and align is not None:
            n -= n % align
        for m in self._steady_full:
            if (num_slots > len(m.req_to_blocks[rid]) * m.block_size
                    or (n is not None and n // m.block_size > m.num_cached_block.get(rid, 0))):
                return False
        state = self._steady_state
        for s in state:
            if not s.steady_step_fits(request, num_main_tokens, n):
                return False
        processed = num_computed_tokens - request.num_in_flight_tokens
        if processed < 0:
            processed = 0
        for s in state:
            s.take_steady_step(request, processed, n)
        return True

    def _grow_and_cache(self, request: RequestLike, need: int, num_slots: int,
                        num_encoder_tokens: int, num_main_tokens: int,
                        num_tokens_to_cache: int | None) -> GroupBlocks:
        """Phase 2 of an allocation the pool can supply: every group grows to its size
        (``num_slots``; encoder groups ``num_encoder_tokens``; types counting their own growth
        ``num_main_tokens``) and, unless ``num_tokens_to_cache`` is ``None``, caches its blocks
        that are full within that many tokens.  Returns the new blocks per group."""
        # A type counting its own growth may reserve a block at a position it already holds:
        # it is asked even when nothing is needed.
        if need or self._own_growth:
            rid = request.request_id
            grown = []
            for m, sizing in zip(self.managers, self._sizing):
                grown.append(m.allocate_new_blocks(
                    rid, num_slots if sizing == 0 else num_encoder_tokens if sizing == 1
                    else num_main_tokens))
            new_blocks = tuple(grown)
        else:
            new_blocks = self.no_blocks
        if num_tokens_to_cache is not None:
            if self.cache_alignment is None:  # cache_blocks, inlined for the common case
                rid = request.request_id
                for m in self._caching:
                    if (num_tokens_to_cache // m.block_size > m.num_cached_block.get(rid, 0)
                            or m.caches_partial_tail):
                        m.cache_blocks(request, num_tokens_to_cache)
            else:
                self.cache_blocks(request, num_tokens_to_cache)
        return new_blocks

    def _adopt_chains(self, request_id: str, hits: Sequence[Sequence[KVCacheBlock]]) -> None:
        """Verify mode: the request's prefix chain continues its (proven) hit's, per block size."""
        chains = self.prefix_chains
        assert chains is not None
        deepest: dict[int, PrefixNode] = {}
        for m, blocks in zip(self.managers, hits):
            node = next((b.prefix_node for b in reversed(blocks) if not b.is_null), None)
            if node is None:
                continue
            best = deepest.get(m.block_size)
            if best is None or best.index < node.index:
                deepest[m.block_size] = node
        for block_size, node in deepest.items():
            chains.adopt(request_id, block_size, node)

    def cache_blocks(self, request: RequestLike, num_tokens: int) -> None:
        """Every caching group caches the request's blocks full within ``num_tokens`` tokens
        (aligned down to ``cache_alignment``; in a group whose hits drop under EAGLE, one block
        further, since an aligned hit is found one block past its boundary)."""
        rid = request.request_id
        align = self.cache_alignment
        aligned = num_tokens if align is None else num_tokens - num_tokens % align
        eagle = self.use_eagle and align is not None
        for m in self._caching:
            n = aligned
            if eagle and aligned and m.use_eagle:
                # An EAGLE lookup matches one block past an aligned boundary and drops it: that
                # block must be cached too (as vLLM).
                n = min(num_tokens, aligned + m.block_size)
            if n // m.block_size > m.num_cached_block.get(rid, 0) or m.caches_partial_tail:
                m.cache_blocks(request, n)

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        for m in self._releasing:
            m.remove_skipped_blocks(request_id, num_computed_tokens)

    def free(self, request_id: str) -> None:
        for manager in self.managers:
            manager.free(request_id)
        # (_forget inlined: a call costs ~60 ns of a ~1.3 µs pure-Python free.)
        if self.shared_prefix_boundaries:
            self.shared_prefix_boundaries.pop(request_id, None)
        if self.prefix_chains is not None:
            self.prefix_chains.drop(request_id)

    def pop_blocks(self, request_id: str) -> list[KVCacheBlock]:
        """Forget the request in every group and hand back its blocks, group after group, each
        in allocation order (null positions left out), still referenced (deferred frees)."""
        out: list[KVCacheBlock] = []
        for manager in self.managers:
            out.extend(b for b in manager.pop_blocks(request_id) if not b.is_null)
        self._forget(request_id)
        return out

    def _forget(self, request_id: str) -> None:
        if self.shared_prefix_boundaries:
            self.shared_prefix_boundaries.pop(request_id, None)
        if self.prefix_chains is not None:
            self.prefix_chains.drop(request_id)

    def get_blocks(self, request_id: str) -> GroupBlocks:
        return tuple([m.req_to_blocks.get(request_id) or [] for m in self.managers])

    def new_step(self) -> None:
        for manager in self.managers:
            manager.new_step()

    # -- per-group queries and chores for KVCacheManager ------------------------------------------
    def report_prefix_hit(self, request: KVRequest,
                          hit: Sequence[Sequence[KVCacheBlock]]) -> None:
        """Record a ``BlockStored`` event per group for the request's hit blocks (one list per
        group; nothing without events)."""
        for m, blocks in zip(self.managers, hit):
            if blocks:
                self.pool.report_cached_blocks(
                    request, len(blocks), m.block_size, m.group_id,
                    hashes_at(request.block_hashes, self.hash_block_size, m.block_size))

    def uncache_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Every group drops the request's blocks holding tokens at or after
        ``num_computed_tokens`` from the prefix cache."""
        for m in self.managers:
            m.uncache_blocks(request_id, num_computed_tokens)

    def first_token_in(self, request_id: str, block_ids: Collection[int]) -> int | None:
        """The first position of the request's tokens any group holds in one of
        ``block_ids`` (see ``SingleTypeKVCacheManager.first_token_in``), or ``None``."""
        first: int | None = None
        for m in self.managers:
            p = m.first_token_in(request_id, block_ids)
            if p is not None and (first is None or p < first):
                first = p
        return first

    def can_resume(self, request_id: str, num_tokens: int) -> bool:
        """Whether every group can go on from ``num_tokens`` computed tokens."""
        return all(m.can_resume(request_id, num_tokens) for m in self.managers)

    def partial_block_ids(self, request_id: str, num_tokens: int) -> list[int]:
        """Per group, the id of the block holding token ``num_tokens`` when that token is not
        the first of its block and the block is real and allocated."""
        ids: list[int] = []
        for m in self.managers:
            blocks = m.req_to_blocks.get(request_id) or ()
            i, offset = divmod(num_tokens, m.block_size)
            if offset and i < len(blocks) and not blocks[i].is_null:
                ids.append(blocks[i].block_id)
        return ids

    def common_prefix_blocks(self, request_id: str, num_running_requests: int) -> list[int]:
        """Per group, how many leading blocks of the request every running request shares."""
        return [m.get_num_common_prefix_blocks(request_id, num_running_requests)
                for m in self.managers]

    def hint_hashes(self, block_hashes: Iterable[Sequence[BlockHash]]) -> list[list[BlockHash]]:
        """Per group (by group id), the hashes of these requests' blocks at the group's block
        size, request after request; empty for groups that never cache."""
        per_group: list[list[BlockHash]] = [[] for _ in self.managers]
        caching = self._caching
        for hashes in block_hashes:
            for m in caching:
                per_group[m.group_id].extend(
                    hashes_at(hashes, self.hash_block_size, m.block_size))
        return per_group

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()
