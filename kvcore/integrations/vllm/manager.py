"""kvcore's KV-cache manager with vLLM's ``KVCacheManager`` surface (vLLM 0.32 and 0.33).

:class:`KVCacheManagerAdapter` is what ``Scheduler.kv_cache_manager`` holds when kvcore runs
inside vLLM.  It takes vLLM's constructor arguments and requests and returns vLLM's own types
(``KVCacheBlocks``, ``KVCacheEvent``, ``PrefixCacheStats``); every decision is made by a
:class:`kvcore.manager.KVCacheManager` over the same groups and the same pool size, so block ids
are vLLM's (0 is the null block) and vLLM's workers need no change.  The installed vLLM's
version picks the semantics where 0.32 and 0.33 differ (:mod:`~kvcore.integrations.vllm.version`).

Where vLLM's manager surface and kvcore's differ, the adapter speaks vLLM:

* the admission ``watermark`` (``watermark_blocks`` of the pool) is kept free when a waiting
  or preempted request is admitted while others are scheduled (``has_scheduled_reqs``), as
  vLLM's manager does: kvcore's ``allocate_slots(watermark_blocks=...)``;
* a ``metrics_collector`` (vLLM's ``KVCacheMetricsCollector``, ``kv_cache_metrics``) observes
  kvcore's pool (:mod:`kvcore.pool.observer`): it is called on allocation, hit, eviction and
  reset with vLLM's arguments at vLLM's moments;
* ``free`` of a request that holds no blocks (aborted before its first allocation) does
  nothing, as in vLLM (kvcore's own manager refuses it: a double free there is a bug);
* before a running request grows, blocks that left its window are released on vLLM's
  processed-token boundary even if the allocation then fails, as vLLM does;
* block copies (copy-on-write) recorded in a group's pending list — by kvcore, or by a caller
  through the group view's ``_pending_cow_copies`` — leave through
  ``take_kv_cache_block_copies`` with their endpoints withheld, which vLLM's scheduler returns
  through ``block_pool.free_blocks`` once the copy's step has been processed;
* partial-block hits (vLLM's partial hash hits) record their copies-on-write as any block
  copy, and a Mamba producer's partial prompt tail reaches KV connectors through
  ``take_boundary_state_offloads`` (its copy) or ``finalize_partial_tail_offloads`` (a request
  finishing on it), as vLLM hands them off;
* ``block_pool``, ``coordinator`` and its ``single_type_managers`` are views answering the
  names vLLM's callers read on vLLM's own objects (:mod:`~kvcore.integrations.vllm.views`);
* the waiting queue's head that did not fit, asked again every step, is answered from memory
  while nothing that decides the answer has changed (the ``retry_memo`` setting,
  :mod:`~kvcore.integrations.vllm.retry`): the same lookup, the same failure.

Requests are seen through :class:`~kvcore.integrations.vllm.request.VllmRequestView`, made once
per admission, so kvcore hashes nothing itself: its prefix cache and events use vLLM's hashes
(lookahead hashes included: a block is cached once vLLM has hashed it).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import vllm.envs as envs
from vllm.distributed.kv_events import KVCacheEvent as VllmKVCacheEvent
from vllm.v1.core.kv_cache_manager import KVCacheBlocks as VllmKVCacheBlocks
from vllm.v1.metrics.stats import PrefixCacheStats as VllmPrefixCacheStats
from vllm.v1.request import RequestStatus

from kvcore.errors import InvalidArgumentError
from kvcore.eviction import PolicyFactory
from kvcore.hashing import EngineHashes
from kvcore.integrations.vllm.config import eagle_groups, kvcore_config, refuse, zeroing_groups
from kvcore.integrations.vllm.events import VllmEventRecorder
from kvcore.integrations.vllm.request import VllmRequestView
from kvcore.integrations.vllm.retry import RetryMemo
from kvcore.integrations.vllm.settings import KvcoreSettings
from kvcore.integrations.vllm.version import VllmVersion, installed
from kvcore.integrations.vllm.views import BlockPoolView, coordinator_view
from kvcore.manager import KVCacheManager, lookup_boundary
from kvcore.managers import MambaAlignManager
from kvcore.types import KVCacheBlock

# The request states vLLM's manager keeps the watermark free for.
_WATERMARKED = (RequestStatus.WAITING, RequestStatus.PREEMPTED)


class KVCacheManagerAdapter:
    """vLLM's ``KVCacheManager``, implemented by kvcore (see the module docstring).

    Constructed by vLLM's ``Scheduler.__init__`` with its own keyword arguments (the integration
    binds ``settings``); raises :class:`~kvcore.errors.UnsupportedFeatureError` for a vLLM
    version kvcore does not run on (:func:`~kvcore.integrations.vllm.version.installed`) and for
    any configuration kvcore would manage differently from vLLM.  ``vllm_version`` is the
    version already checked (kvcore's scheduler passes it; tests override the installed one);
    ``eviction_policy``, a
    policy factory, replaces the settings' policy (the vLLM replay's offline bounds, which
    vLLM's configuration refuses: :mod:`~kvcore.integrations.vllm.replay_oracle`).
    """

    def __init__(self, kv_cache_config: Any, max_model_len: int, scheduler_block_size: int,
                 hash_block_size: int, max_in_flight_tokens: int | None = None,
                 enable_caching: bool = True, use_eagle: bool = False,
                 num_hash_lookahead_tokens: int = 0,
                 num_prefill_lookahead: int = 0, log_stats: bool = False,
                 enable_kv_cache_events: bool = False, dcp_world_size: int = 1,
                 pcp_world_size: int = 1, metrics_collector: Any = None, watermark: float = 0.0,
                 enable_mamba_shared_prefix_checkpoint: bool = False, *,
                 settings: KvcoreSettings | None = None,
                 vllm_version: VllmVersion | None = None,
                 eviction_policy: PolicyFactory | None = None) -> None:
        settings = settings if settings is not None else KvcoreSettings()
        version = (vllm_version if vllm_version is not None
                   else installed(allow_unreleased=settings.allow_unreleased_vllm))
        if dcp_world_size > 1 or pcp_world_size > 1:
            raise refuse(f"context parallelism (decode {dcp_world_size}, prefill "
                         f"{pcp_world_size} ranks)", "set decode_context_parallel_size=1")
        if num_prefill_lookahead > 1:
            raise refuse(f"multi-module MTP prefill lookahead ({num_prefill_lookahead} tokens)",
                         "use at most one speculative token per step with prefix caching")
        if (isinstance(watermark, bool) or not isinstance(watermark, (int, float))
                or not watermark >= 0.0):
            raise InvalidArgumentError(
                f"watermark must be a fraction of the blocks >= 0, got {watermark!r}")
        if num_hash_lookahead_tokens and not version.lookahead_hashes:
            raise refuse(f"lookahead block hashes on vLLM {version.text}",
                         "use vLLM 0.33 for them")
        config = kvcore_config(kv_cache_config, scheduler_block_size=scheduler_block_size,
                               hash_block_size=hash_block_size, enable_caching=enable_caching,
                               version=version)
        eagle_ids, drop_ids = eagle_groups(kv_cache_config, use_eagle, version)
        has_mamba = any(g.spec.holds_state for g in config.groups)
        if has_mamba and num_hash_lookahead_tokens:
            raise refuse("lookahead block hashes (vLLM 0.33's EAGLE/MTP without a block drop) "
                         "on a hybrid Mamba model",
                         "run the hybrid model without speculative decoding")
        if has_mamba and drop_ids and not use_eagle:
            # vLLM moves Mamba checkpoints to EAGLE's replay boundary only under use_eagle.
            raise refuse("an EAGLE block drop on a hybrid Mamba model without use_eagle (groups "
                         "flagged is_eagle_group)", "pass use_eagle with the EAGLE groups")
        self.vllm_version = version
        self.settings = settings
        self.kv_cache_config = kv_cache_config
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.enable_kv_cache_events = enable_kv_cache_events
        self.use_eagle = use_eagle
        self.num_hash_lookahead_tokens = num_hash_lookahead_tokens
        self.log_stats = log_stats
        self.num_kv_cache_groups = len(kv_cache_config.kv_cache_groups)
        self.watermark_blocks = int(watermark * kv_cache_config.num_blocks)
        self.metrics_collector = metrics_collector
        # Published hashes: 64-bit ints (vLLM's default) or the bytes.  Read once, as vLLM's
        # environment is fixed once its engine has started.
        int_hashes = bool(envs.VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES)
        # Prefix-cache stats are kept here, in vLLM's own type (as vLLM's manager keeps them).
        self.kv = KVCacheManager(
            config, max_model_len, enable_caching=enable_caching,
            verify_hits=settings.verify_hits, enable_events=enable_kv_cache_events,
            log_stats=False,
            max_num_batched_tokens=max_in_flight_tokens or max_model_len,
            block_hasher=EngineHashes(), use_eagle=bool(drop_ids),
            eagle_groups=tuple(sorted(drop_ids)),
            num_hash_lookahead_tokens=num_hash_lookahead_tokens,
            eagle_junction_tail=version.eagle_junction_tail,
            mamba_recache_prompt_boundary=version.mamba_recache_prompt_boundary,
            # vLLM honours it on EAGLE models (flagged or use_eagle groups) with partial hits.
            mamba_shared_prefix_checkpoint=(enable_mamba_shared_prefix_checkpoint
                                            and bool(eagle_ids)),
            eviction_policy=(settings.eviction_policy if eviction_policy is None
                             else eviction_policy),
            events=VllmEventRecorder(config, num_hash_lookahead_tokens, int_hashes))
        # vLLM's scheduler also ends prompt chunks at the junction when this is on.
        self.mamba_shared_prefix_checkpoint = self.kv.coordinator.shared_prefix_checkpoint
        if metrics_collector is not None:  # vLLM's residency metrics observe kvcore's pool
            self.kv.pool.set_observer(metrics_collector)
        self.block_pool = BlockPoolView(self.kv, hash_block_size, num_hash_lookahead_tokens)
        self.coordinator = coordinator_view(self.kv, kv_cache_config, self.block_pool,
                                            eagle_ids, drop_ids)
        self.empty_kv_cache_blocks = VllmKVCacheBlocks(
            tuple(() for _ in range(self.num_kv_cache_groups)))
        self.prefix_cache_stats: VllmPrefixCacheStats | None = (
            VllmPrefixCacheStats() if log_stats else None)
        # Requests holding blocks, by id: the view kvcore's manager tracks them by.
        self._views: dict[str, VllmRequestView] = {}
        # The view of the latest lookup, reused when that request is admitted next (kvcore's
        # manager then knows the hit it returned and need not check it again).
        self._lookup: VllmRequestView | None = None
        self._releases = any(m.releases_blocks for m in self.kv.coordinator.managers)
        self._state_managers = [m for m in self.kv.coordinator.managers
                                if isinstance(m, MambaAlignManager)]
        # Block zeroing (Mamba models, mixed precisions): the groups whose new blocks vLLM's
        # workers zero, and per group the block ids recorded since take_new_block_ids().
        self._zeroing = zeroing_groups(kv_cache_config)
        self._new_block_ids: list[list[int]] = [[] for _ in range(self.num_kv_cache_groups)]
        self._steps = 0
        # The head-of-line retry's memo (None: off, or nothing to remember without caching).
        self.retry_memo: RetryMemo | None = (
            RetryMemo(self.kv.pool, self.kv.coordinator.managers)
            if settings.retry_memo and enable_caching else None)

    # -- requests -------------------------------------------------------------------------
    def _view(self, request: Any) -> VllmRequestView:
        view = self._views.get(request.request_id)
        if view is not None and view.vllm is request:
            return view
        view = self._lookup
        if view is not None and view.vllm is request:
            return view
        view = VllmRequestView(request)
        self._lookup = view
        return view

    def _blocks(self, groups: tuple[Sequence[KVCacheBlock], ...]) -> VllmKVCacheBlocks:
        """vLLM's ``KVCacheBlocks`` over per-group lists (kvcore's ``KVCacheBlocks`` is such a
        tuple already), or its shared empty one."""
        for blocks in groups:  # (a loop, not any(): native in the compiled build)
            if blocks:
                return VllmKVCacheBlocks(groups)
        return self.empty_kv_cache_blocks

    # -- vLLM's KVCacheManager ----------------------------------------------------------------
    @property
    def usage(self) -> float:
        return self.kv.usage

    @property
    def retained_hit_group_ids(self) -> tuple[int, ...]:
        """The groups whose hit blocks beyond the agreed hit an admission keeps as far as its
        local and external tokens reach (vLLM's; a KV connector's bind sets it, with the
        groups' ``retains_longer_hit``: kvcore keeps one set behind both,
        ``KVCacheManager.retain_longer_hits``)."""
        return tuple(sorted(self.kv.retained_hit_groups))

    @retained_hit_group_ids.setter
    def retained_hit_group_ids(self, group_ids: Iterable[int]) -> None:
        self.kv.retain_longer_hits(group_ids)

    def make_prefix_cache_stats(self) -> VllmPrefixCacheStats | None:
        stats = self.prefix_cache_stats
        if stats is None:
            return None
        self.prefix_cache_stats = VllmPrefixCacheStats()
        return stats

    def prefix_cache_lookup_enabled(self, request: Any) -> bool:
        return self.enable_caching and not request.skip_reading_prefix_cache

    def record_prefix_cache_stats(self, request: Any, num_hits: int) -> None:
        """Count one admission's lookup (none for a request that skipped the cache)."""
        stats = self.prefix_cache_stats
        if stats is not None and self.enable_caching and not request.skip_reading_prefix_cache:
            stats.record(num_tokens=request.num_tokens, num_hits=num_hits,
                         preempted=request.num_preemptions > 0)

    def get_computed_blocks(self, request: Any, max_cache_hit_length: int | None = None
                            ) -> tuple[VllmKVCacheBlocks, int, int]:
        """(hit blocks per group, hit tokens, shared-prefix boundary); the hit covers at most
        ``max_cache_hit_length`` tokens (vLLM 0.33; default and bound: all but the last)."""
        if not self.enable_caching or request.skip_reading_prefix_cache:
            return self.empty_kv_cache_blocks, 0, 0
        retry = self.retry_memo
        if retry is not None:
            look = retry.lookup(request, max_cache_hit_length)
            if look is not None:  # the head again, nothing changed: the same answer
                self._lookup = look.view
                if (look.answer[1] and self.enable_kv_cache_events
                        and getattr(request, "kv_cache_report_mode", "incremental") == "full"):
                    self.kv.report_prefix_hit(look.view, look.hit)
                return look.answer
        view = self._view(request)
        hit, num_hit_tokens = self.kv.get_computed_blocks(view, max_cache_hit_length)
        if (num_hit_tokens and self.enable_kv_cache_events
                and getattr(request, "kv_cache_report_mode", "incremental") == "full"):
            self.kv.report_prefix_hit(view, hit)
        # kvcore's own hit object rides along: allocate_slots hands it back unchanged.  The
        # boundary travels with it; vLLM's scheduler keeps it on the request for the admission.
        answer = self._blocks(hit), num_hit_tokens, lookup_boundary(hit, view)
        if retry is not None:
            retry.looked_up(request, view, hit, answer, max_cache_hit_length)
        return answer

    def cached_prefix_tokens(self, request: Any) -> int:
        """The tokens of ``request``'s prefix cached now, as ``get_computed_blocks`` would hit
        them: no stats, no events, no reference taken (the ``lpm`` admission order's
        estimate)."""
        if not self.enable_caching or request.skip_reading_prefix_cache:
            return 0
        return self.kv.get_computed_blocks(self._view(request))[1]

    def get_computed_blocks_for_connector(
            self, request: Any, max_cache_hit_length: int | None = None
    ) -> tuple[VllmKVCacheBlocks, int, int, bool]:
        """The local lookup of a request scheduled with a KV connector.  Hybrid Mamba models,
        as vLLM: full attention's own hit when no group hit deeper (flagged diverged when some
        group hit less: the connector refills it, or the scheduler falls back), else the hit
        every group agrees on.  Other models: the plain lookup, never diverged."""
        coord = self.coordinator
        fa = coord.full_attention_group_id
        if not self._state_managers or fa is None:
            return (*self.get_computed_blocks(request, max_cache_hit_length), False)
        if not self.enable_caching or request.skip_reading_prefix_cache:
            return self.empty_kv_cache_blocks, 0, 0, False
        blocks, hits = coord.find_longest_cache_hit_per_group(request.block_hashes,
                                                              request.num_tokens - 1)
        if any(hit > hits[fa] for hit in hits):
            return (*self.get_computed_blocks(request, max_cache_hit_length), False)
        return self._blocks(blocks), hits[fa], 0, min(hits) < hits[fa]

    def allocate_slots(self, request: Any, num_new_tokens: int, num_new_computed_tokens: int = 0,
                       new_computed_blocks: VllmKVCacheBlocks | None = None,
                       num_lookahead_tokens: int = 0, num_external_computed_tokens: int = 0,
                       delay_cache_blocks: bool = False, num_encoder_tokens: int = 0,
                       full_sequence_must_fit: bool = False, reserved_blocks: int = 0,
                       has_scheduled_reqs: bool = True,
                       skip_zeroing_group_ids: tuple[int, ...] = ()) -> VllmKVCacheBlocks | None:
        """vLLM's ``allocate_slots``: a waiting or preempted request admitted while others
        are scheduled (``has_scheduled_reqs``) leaves ``watermark_blocks`` free besides
        ``reserved_blocks``; ``skip_zeroing_group_ids``: groups whose blocks for externally
        computed tokens are not recorded for zeroing (the load writes them)."""
        rid = request.request_id
        tracked = self._views.get(rid)
        running = tracked is not None and tracked.vllm is request
        if running and self._releases:
            # vLLM releases what left the window before it checks for space, on the tokens
            # whose step was processed.
            processed = request.num_computed_tokens - request.num_in_flight_tokens
            self.kv.remove_skipped_blocks(rid, processed if processed > 0 else 0)
        view = tracked if running and tracked is not None else self._view(request)
        hits = None
        if (new_computed_blocks is not None
                and new_computed_blocks is not self.empty_kv_cache_blocks):
            hits = new_computed_blocks.blocks
        # The shared-prefix boundary of the request's latest lookup, which vLLM's scheduler (0.33)
        # keeps on the request: the hit it hands back may have lost kvcore's stamp (rebuilt,
        # truncated, or the shared empty one).  None (older vLLM, or 0): the one the hit carries.
        boundary = None if running else getattr(request, "shared_prefix_boundary", 0) or None
        watermark = self.watermark_blocks
        watermarked = bool(watermark) and has_scheduled_reqs and request.status in _WATERMARKED
        retry = None if running else self.retry_memo
        key = None
        if retry is not None:
            # Everything besides the pool that decides whether an admission fits.
            key = (num_new_tokens, num_new_computed_tokens, num_lookahead_tokens,
                   num_external_computed_tokens, delay_cache_blocks, num_encoder_tokens,
                   full_sequence_must_fit, reserved_blocks, watermarked, skip_zeroing_group_ids,
                   request.num_tokens, request.num_computed_tokens, boundary)
            if retry.refuses(request, key, new_computed_blocks):
                return None
        if watermarked:
            new = self.kv.allocate_slots(
                view, num_new_tokens, num_new_computed_tokens, hits,
                num_lookahead_tokens, num_external_computed_tokens, delay_cache_blocks,
                num_encoder_tokens, full_sequence_must_fit, reserved_blocks, watermark,
                shared_prefix_boundary=boundary)
        else:  # (no watermark argument: kvcore's fast path takes the call)
            new = self.kv.allocate_slots(
                view, num_new_tokens, num_new_computed_tokens, hits,
                num_lookahead_tokens, num_external_computed_tokens, delay_cache_blocks,
                num_encoder_tokens, full_sequence_must_fit, reserved_blocks,
                shared_prefix_boundary=boundary)
        if new is None:
            if retry is not None and key is not None:
                retry.failed(request, key, new_computed_blocks)
            return None
        if self._zeroing and (not running or any(new)):  # (a running request's step: only
            # its new blocks are recorded, and a decode step mostly takes none)
            self._record_zeroing(rid, running, new, hits, num_external_computed_tokens,
                                 skip_zeroing_group_ids)
        if not running:
            self._views[rid] = view
            if self._lookup is view:
                self._lookup = None
            if retry is not None:
                retry.forget(request)
        return self._blocks(new)

    def _record_zeroing(self, rid: str, running: bool, new: Sequence[Sequence[KVCacheBlock]],
                        hits: Any, num_external: int, skip: tuple[int, ...]) -> None:
        """Record the blocks this allocation took for vLLM's workers to zero, per group, as
        vLLM's managers do: a new request's blocks for externally computed tokens (unless its
        group is in ``skip``: the load writes them), then the new blocks."""
        tables = self.kv.coordinator.get_blocks(rid) if num_external and not running else None
        for g in self._zeroing:
            out = self._new_block_ids[g]
            grown = new[g]
            if tables is not None and g not in skip:
                # (The new blocks are the table's tail, except a partial hit's copy, which
                # took its shared block's place: left out by id.)
                skipped = {b.block_id for b in grown}
                if hits:
                    skipped.update(b.block_id for b in hits[g])
                out.extend(b.block_id for b in tables[g]
                           if not b.is_null and b.block_id not in skipped)
            out.extend(b.block_id for b in grown if not b.is_null)

    def free(self, request: Any) -> None:
        """Release the request's blocks, tail first; nothing for a request without blocks."""
        view = self._views.pop(request.request_id, None)
        if view is None:
            if self.retry_memo is not None:  # a waiting request left (aborted)
                self.retry_memo.forget(request)
            return
        self.kv.free(view)

    def pop_blocks_for_free(self, request: Any) -> list[KVCacheBlock]:
        """vLLM's deferred free: forget the request and hand back its blocks still referenced;
        vLLM's scheduler returns them through ``block_pool.free_blocks`` once the step that may
        still write them has finished (kvcore's ``free_withheld``).  Nothing for a request that
        holds no blocks."""
        view = self._views.pop(request.request_id, None)
        if view is None:
            return []
        return self.kv.pop_blocks_for_free(view)

    def remove_skipped_blocks(self, request_id: str, processed_computed_tokens: int,
                              num_prompt_tokens: int | None = None) -> None:
        if request_id in self._views:
            self.kv.remove_skipped_blocks(request_id, max(0, processed_computed_tokens))

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        self.kv.evict_blocks(block_ids)

    def reset_prefix_cache(self) -> bool:
        if not self.kv.reset_prefix_cache():
            return False
        if self.prefix_cache_stats is not None:
            self.prefix_cache_stats.reset = True
        return True

    def get_num_common_prefix_blocks(self, running_request_id: str) -> list[int]:
        """Always 0 per group, as vLLM 0.32 (cascade attention was removed)."""
        return [0] * self.num_kv_cache_groups

    def take_events(self) -> list[VllmKVCacheEvent]:
        """The events recorded since the last call: vLLM's objects, hashes as vLLM publishes
        them (the pool records them so, :mod:`~kvcore.integrations.vllm.events`)."""
        return self.kv.take_events()

    def get_blocks(self, request_id: str) -> VllmKVCacheBlocks:
        return self._blocks(self.kv.coordinator.get_blocks(request_id))

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        return tuple([b.block_id for b in g] for g in self.kv.coordinator.get_blocks(request_id))

    def get_block_ids_for_computed_tokens(self, request_id: str,
                                          num_computed_tokens: int) -> tuple[list[int], ...]:
        """The block ids covering the first ``num_computed_tokens`` tokens, per group (all of
        an encoder group's: they hold the encoder output, not the decoder's tokens)."""
        out = []
        for m, blocks in zip(self.kv.coordinator.managers,
                             self.kv.coordinator.get_blocks(request_id)):
            n = len(blocks) if m.uses_encoder_tokens else -(-num_computed_tokens // m.block_size)
            out.append([b.block_id for b in blocks[:n]])
        return tuple(out)

    def estimate_cached_tokens(self, request: Any) -> int:
        """The prefix tokens the request's cached blocks cover, least over the caching groups
        (vLLM's prefill statistic)."""
        pool = self.kv.pool
        least: int | None = None
        for m, blocks in zip(self.kv.coordinator.managers,
                             self.kv.coordinator.get_blocks(request.request_id)):
            if not m.enable_caching:
                continue
            covered = 0
            for i, block in enumerate(blocks):
                if block.block_hash is not None:
                    partial = pool.partial_primary_tokens(block)
                    covered = max(covered, (i + 1) * m.block_size if partial is None else partial)
            least = covered if least is None else min(least, covered)
        return least or 0

    def cache_blocks(self, request: Any, num_computed_tokens: int) -> None:
        """Cache the request's blocks full (and hashed) within its first
        ``num_computed_tokens`` tokens; a request holding no blocks raises
        :class:`~kvcore.errors.UnknownRequestError` (a ``KeyError``, as vLLM's manager)."""
        if self.enable_caching:
            view = self._views.get(request.request_id)
            # An untracked request: kvcore's manager raises, naming it.
            self.kv.cache_blocks(view if view is not None else request, num_computed_tokens)

    def rewind_after_failed_load(self, request: Any) -> bool:
        """vLLM set ``request`` back to the first block a KV load failed to write (its
        ``num_computed_tokens``): whether kvcore's tables let it go on from there
        (``KVCacheManager.can_resume``).  When they do not (a sliding window or chunk released
        blocks it reads, a state group holds only its latest state), what it holds from there
        on also leaves the prefix cache (vLLM's recompute policy keeps it, for the request to
        rewrite): it must start over.  True for a request that holds no blocks."""
        view = self._views.get(request.request_id)
        if view is None:
            return True
        n = request.num_computed_tokens
        if self.kv.can_resume(request.request_id, n):
            return True
        self.kv.uncache_blocks(view, n)
        return False

    def create_kv_cache_blocks(self, blocks: Sequence[Sequence[KVCacheBlock]]) -> VllmKVCacheBlocks:
        return self._blocks(tuple(blocks))

    def truncate_computed_blocks(self, blocks: VllmKVCacheBlocks,
                                 num_computed_tokens: int) -> VllmKVCacheBlocks:
        """The first ``num_computed_tokens`` tokens' worth of a lookup result (no ref counts
        change; scratch groups' slots stay empty)."""
        out: list[list[KVCacheBlock]] = []
        for m, group in zip(self.kv.coordinator.managers, blocks.blocks):
            if not m.spec.prefix_cacheable:
                # A scratch group (a circular buffer, a replayed window) is never part of a hit
                # and covers no token range: its slot stays empty, whatever its block size.
                out.append([])
                continue
            if num_computed_tokens % m.block_size:
                raise refuse("a hit truncated inside a block", "use whole-block hits")
            out.append(list(group[:num_computed_tokens // m.block_size]))
        return self._blocks(tuple(out))

    def take_new_block_ids(self) -> list[int]:
        """The block ids recorded for zeroing since the last call, group after group."""
        out = [bid for ids in self._new_block_ids for bid in ids]
        for ids in self._new_block_ids:
            ids.clear()
        return out

    def record_blocks_for_zeroing(self, request_id: str, start_token: int) -> None:
        """Record the request's blocks from ``start_token`` (a block boundary) on for zeroing
        again, e.g. those a failed KV load left unwritten."""
        tables = self.kv.coordinator.get_blocks(request_id)
        managers = self.kv.coordinator.managers
        for g in self._zeroing:
            bs = managers[g].block_size
            if start_token % bs:
                raise refuse(f"zeroing from token {start_token}, inside a block of {bs}",
                             "zero from a block boundary")
            self._new_block_ids[g].extend(b.block_id for b in tables[g][start_token // bs:])

    def take_kv_cache_block_copies(self) -> tuple[list[Any], list[KVCacheBlock]]:
        """The block copies recorded since the last call, as vLLM's ``KVCacheBlockCopy``
        objects, and their endpoints (source and destination of each copy, in order), which stay
        withheld: vLLM's scheduler returns them through ``block_pool.free_blocks`` once the step
        that runs the copies has been processed (kvcore's ``take_block_copies``)."""
        pairs, retained = self.kv.take_block_copies()
        if not pairs:
            return [], []
        from vllm.v1.core.kv_cache_utils import KVCacheBlockCopy

        return [KVCacheBlockCopy(src_block_id=src.block_id, dst_block_id=dst.block_id)
                for src, dst in pairs], retained

    def take_boundary_state_offloads(self) -> dict[str, list[tuple[int, int, int]]]:
        """The Mamba "align" states cached since the last call, for a KV connector:
        ``{request id: [(group id, block id, boundary tokens), ...]}`` (empty without Mamba)."""
        out: dict[str, list[tuple[int, int, int]]] = {}
        for m in self._state_managers:
            for rid, group, block, tokens in m.take_boundary_state_offloads():
                out.setdefault(rid, []).append((group, block.block_id, tokens))
        return out

    def finalize_partial_tail_offloads(self, request: Any) -> list[tuple[int, int, int]]:
        """A finishing request's Mamba "align" partial prompt tails still in its state blocks
        (partial-block hits), ``[(group id, block id, boundary tokens), ...]``, for a KV
        connector to offload before the request's blocks are released (vLLM's)."""
        out: list[tuple[int, int, int]] = []
        for m in self._state_managers:
            found = m.finalize_partial_tail(request.request_id, request.num_computed_tokens,
                                            getattr(request, "num_in_flight_tokens", 0))
            if found is not None:
                out.append((found[0], found[1].block_id, found[2]))
        return out

    def new_step_starts(self) -> None:
        """A scheduling step starts; checks kvcore's invariants every
        ``check_invariants_every`` steps."""
        self.kv.new_step()
        if self.retry_memo is not None:
            self.retry_memo.step += 1
        every = self.settings.check_invariants_every
        if every:
            self._steps += 1
            if self._steps % every == 0:
                self.kv.check_invariants()

    # -- kvcore's additions ---------------------------------------------------------------------
    def declare_upcoming(self, requests: Iterable[Any]) -> None:
        """Scheduler hint: the waiting requests about to run, most urgent first (vLLM requests
        carry what :meth:`kvcore.manager.KVCacheManager.declare_upcoming` reads)."""
        self.kv.declare_upcoming(requests)

    def check_invariants(self) -> None:
        self.kv.check_invariants()
