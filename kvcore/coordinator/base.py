"""KVCacheCoordinator: drives one single-type manager per KV-cache group over one shared pool.

The coordinator sums what every group needs, hands hits to every group in two phases (touch all
groups' hits before any group allocates, so one group's allocation can never evict another
group's not-yet-taken hit), and decides how hits of different groups combine
(``find_longest_cache_hit``, per subclass).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvcore.block_pool import BlockPool
from kvcore.blocks import BlockHash, KVCacheBlock
from kvcore.managers import ManagerClasses, SingleTypeKVCacheManager, make_manager
from kvcore.managers.base import ManagerContext
from kvcore.managers.cross_attention import CrossAttentionManager
from kvcore.request import KVRequest
from kvcore.specs import KVCacheConfig
from kvcore.verify import HitVerifier, PrefixChains

GroupBlocks = tuple[list[KVCacheBlock], ...]


class KVCacheCoordinator:
    """Base: everything except how a prefix hit is found."""

    def __init__(self, config: KVCacheConfig, *, enable_caching: bool, enable_events: bool,
                 verify_hits: bool, alignment_tokens: int, use_eagle: bool = False,
                 manager_classes: ManagerClasses | None = None) -> None:
        self.config = config
        self.enable_caching = enable_caching
        self.verify_hits = verify_hits and enable_caching
        self.use_eagle = use_eagle
        self.pool = BlockPool(config.num_blocks, enable_caching=enable_caching,
                              num_groups=config.num_groups, enable_events=enable_events,
                              verify_hits=self.verify_hits)
        self.hash_block_size = config.hash_block_size
        self.alignment_tokens = alignment_tokens
        self.prefix_chains = PrefixChains() if self.verify_hits else None
        ctx = ManagerContext(self.pool, enable_caching, self.hash_block_size, alignment_tokens,
                             use_eagle, self.prefix_chains)
        self.managers: tuple[SingleTypeKVCacheManager, ...] = tuple(
            make_manager(g.spec, i, ctx, overrides=manager_classes)
            for i, g in enumerate(config.groups))
        self._is_cross = tuple(isinstance(m, CrossAttentionManager) for m in self.managers)
        self._attention = tuple(m for m, cross in zip(self.managers, self._is_cross) if not cross)
        self._caching = tuple(m for m in self.managers if m.enable_caching)
        self._releasing = tuple(m for m in self._attention if m.releases_blocks)
        self._all_attention = len(self._attention) == len(self.managers)

    # -- hits -------------------------------------------------------------------------------------
    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash], max_length: int,
                               verifier: HitVerifier | None) -> tuple[GroupBlocks, int]:
        """Per-group hit blocks and the hit length in tokens (at most ``max_length``)."""
        raise NotImplementedError

    def num_cacheable_tokens(self, num_tokens: int) -> int:
        """How many of the first ``num_tokens`` tokens may be cached (hybrid: aligned down)."""
        return num_tokens

    def eagle_cacheable_tokens(self, num_tokens: int, aligned: int,
                               manager: SingleTypeKVCacheManager) -> int:
        """Under EAGLE, how many tokens ``manager`` caches (``aligned``: the common count)."""
        return aligned

    # -- accounting -------------------------------------------------------------------------------
    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int,
                                   new_computed_blocks: Sequence[Sequence[KVCacheBlock]],
                                   num_encoder_tokens: int, total_computed_tokens: int,
                                   max_blocks: Sequence[int | None] | None = None) -> int:
        """Free blocks all groups need together; ``max_blocks`` caps each group's per-request
        holding (admission of the whole sequence)."""
        n = 0
        for i, manager in enumerate(self.managers):
            cap = None if max_blocks is None else max_blocks[i]
            if self._is_cross[i]:
                n += manager.get_num_blocks_to_allocate(request_id, num_encoder_tokens, (), 0, cap)
            else:
                n += manager.get_num_blocks_to_allocate(request_id, num_tokens,
                                                        new_computed_blocks[i],
                                                        total_computed_tokens, cap)
        return n

    def get_num_freeable_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> int:
        return sum(m.get_num_freeable_skipped_blocks(request_id, num_computed_tokens)
                   for m in self.managers)

    # -- mutation ---------------------------------------------------------------------------------
    def add_computed_blocks(self, request_id: str,
                            new_computed_blocks: Sequence[Sequence[KVCacheBlock]],
                            num_local_computed_tokens: int,
                            num_external_computed_tokens: int) -> None:
        """Phase 1: every group takes its hit blocks.  Phase 2: blocks for external tokens."""
        total = num_local_computed_tokens + num_external_computed_tokens
        for i, manager in enumerate(self.managers):
            manager.add_computed_blocks(request_id, new_computed_blocks[i], total)
        if num_external_computed_tokens > 0:
            for i, manager in enumerate(self.managers):
                if not self._is_cross[i]:
                    manager.allocate_external_computed_blocks(
                        request_id, num_local_computed_tokens, num_external_computed_tokens)

    def allocate_new_blocks(self, request_id: str, num_tokens: int,
                            num_encoder_tokens: int) -> GroupBlocks:
        return tuple(
            m.allocate_new_blocks(request_id, num_encoder_tokens if self._is_cross[i] else num_tokens)
            for i, m in enumerate(self.managers))

    def grow(self, request: KVRequest, num_computed_tokens: int, num_slots: int,
             num_tokens_to_cache: int | None) -> GroupBlocks | None:
        """A running request gets slots up to ``num_slots`` tokens (no hits, no encoder):
        release out-of-window blocks, allocate, cache — in that order for all groups, as the
        general path does — or return ``None`` having changed nothing."""
        rid = request.request_id
        need = 0
        counts = []
        for m in self._attention:
            n = -(-num_slots // m.block_size) - len(m.req_to_blocks[rid])
            counts.append(n)
            if n > 0:
                need += n
        if need and need > (self.pool.num_free_blocks
                            + self.get_num_freeable_skipped_blocks(rid, num_computed_tokens)):
            return None
        for m in self._releasing:
            m.remove_skipped_blocks(rid, num_computed_tokens)
        return self._extend(request, counts, need, num_tokens_to_cache)

    def start(self, request: KVRequest, num_slots: int,
              num_tokens_to_cache: int | None) -> GroupBlocks | None:
        """A new request with nothing computed and no hits gets slots for ``num_slots`` tokens,
        or ``None`` having changed nothing."""
        counts = [-(-num_slots // m.block_size) for m in self._attention]
        need = sum(counts)
        if need > self.pool.num_free_blocks:
            return None
        rid = request.request_id
        for m in self._attention:
            m.req_to_blocks[rid] = []
        return self._extend(request, counts, need, num_tokens_to_cache)

    def _extend(self, request: KVRequest, counts: list[int], need: int,
                num_tokens_to_cache: int | None) -> GroupBlocks:
        """Append ``counts[i]`` new blocks to attention group i (one pool call), then cache."""
        rid = request.request_id
        new_blocks: list[list[KVCacheBlock]] = []
        if need:
            fresh = self.pool.get_new_blocks(need)
            at = 0
            for m, n in zip(self._attention, counts):
                if n > 0:
                    part = fresh[at:at + n] if len(counts) > 1 else fresh
                    at += n
                    m.req_to_blocks[rid].extend(part)
                    new_blocks.append(part)
                else:
                    new_blocks.append([])
        else:
            new_blocks = [[] for _ in counts]
        if num_tokens_to_cache is not None:
            aligned = self.num_cacheable_tokens(num_tokens_to_cache)
            eagle = self.use_eagle
            for m in self._caching:
                num_tokens = (self.eagle_cacheable_tokens(num_tokens_to_cache, aligned, m)
                              if eagle else aligned)
                if (num_tokens // m.block_size > m.num_cached_block.get(rid, 0)
                        or m.caches_partial_tail):
                    m.cache_blocks(request, num_tokens)
        if self._all_attention:
            return tuple(new_blocks)
        it = iter(new_blocks)
        return tuple([] if cross else next(it) for cross in self._is_cross)

    def cache_blocks(self, request: KVRequest, num_tokens: int) -> None:
        aligned = self.num_cacheable_tokens(num_tokens)
        for m in self._caching:
            m.cache_blocks(request, self.eagle_cacheable_tokens(num_tokens, aligned, m)
                           if self.use_eagle else aligned)

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        for manager in self.managers:
            manager.remove_skipped_blocks(request_id, num_computed_tokens)

    def free(self, request_id: str) -> None:
        for manager in self.managers:
            manager.free(request_id)
        if self.prefix_chains is not None:
            self.prefix_chains.drop(request_id)

    def get_blocks(self, request_id: str) -> GroupBlocks:
        return tuple(m.req_to_blocks.get(request_id) or [] for m in self.managers)

    def new_step(self) -> None:
        for manager in self.managers:
            new_step = getattr(manager, "new_step", None)
            if new_step is not None:
                new_step()

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()
