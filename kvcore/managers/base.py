"""SingleTypeKVCacheManager: the block tables of one KV-cache group.

One manager per group; all share one :class:`~kvcore.block_pool.BlockPool`.  A manager knows its
attention type's rules — which cached blocks make a hit (``find_longest_cache_hit``), which
blocks a request no longer needs (``get_num_skipped_tokens``) — and keeps, per request, its block
list and how many of those blocks are already in the prefix cache.

A request's block list has one entry per ``block_size`` tokens; positions that hold no KV (left
the sliding window, before the current chunk, old Mamba states) hold the null block, always as a
leading run.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from itertools import islice
from typing import ClassVar

from kvcore._mypyc import mypyc_attr
from kvcore.block_pool import BlockPool
from kvcore.hashing import hashes_at
from kvcore.request import RequestLike
from kvcore.specs import KVCacheSpec
from kvcore.types import BlockHash, HitBlocks, KVCacheBlock, KVRequest
from kvcore.verify import HitVerifier, PrefixChains

"""One list of hit blocks per group id of a :class:`HitQuery`."""


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class ManagerContext:
    """What the single-type managers of one KV-cache manager share: the pool, whether prefix
    caching is on, the hash granularity and the hit alignment (tokens), EAGLE/MTP drafting
    (``use_eagle``: some group's hits drop their last block; ``eagle_group_ids``: which groups
    drop, ``None`` for all of them), the verify-mode prefix chains, the sparse-retention interval
    (``KVCacheConfig.prefix_cache_retention_interval``) and, per running request, the shared
    prefix its admission lookup found some group holding beyond the common hit (a token
    position; the coordinator keeps it), and whether EAGLE retention also keeps the tail one
    block below that junction (``CacheSettings.eagle_junction_tail``), and whether Mamba "align"
    marks the prompt's last boundary state cached this step again whenever a chunk ends there
    (``CacheSettings.mamba_recache_prompt_boundary``)."""

    pool: BlockPool
    enable_caching: bool
    hash_block_size: int
    alignment_tokens: int
    use_eagle: bool = False
    prefix_chains: PrefixChains | None = None
    retention_interval: int | None = None
    shared_prefix_boundaries: dict[str, int] = field(default_factory=dict)
    eagle_junction_tail: bool = True
    mamba_recache_prompt_boundary: bool = False
    eagle_group_ids: frozenset[int] | None = None
    partial_block_hits: bool = False
    mamba_shared_prefix_checkpoint: bool = False
    """Whether Mamba "align" groups key the state at a request's shared-prefix junction
    (``CacheSettings.mamba_shared_prefix_checkpoint``, in effect: with partial hits)."""
    scheduler_alignment: int = 0
    """The lcm of the block sizes (vLLM's scheduler block), where a prompt's replay boundaries
    lie; 0: ``alignment_tokens`` (they differ under partial-block hits only)."""
    withheld: dict[int, int] = field(default_factory=dict)
    """The references withheld from the pool by block id (``KVCacheManager``'s deferred
    frees, block copies' endpoints): a copy-on-write of a partial-block hit withholds its
    endpoints here."""


@dataclass(slots=True)
class HitQuery:
    """One prefix-cache lookup, for the groups ``group_ids`` that share ``spec``.

    ``block_hashes`` are the request's hashes at ``spec.block_size``; the hit may cover at most
    ``max_length`` tokens and must be a multiple of ``alignment_tokens``.  ``verifier`` (verify
    mode) proves each found block's prefix equal to the request's (:mod:`kvcore.verify`).
    ``drop_last`` (EAGLE/MTP drafting) drops the hit's last block, whose tokens the draft model
    must recompute.
    """

    block_hashes: Sequence[BlockHash]
    max_length: int
    group_ids: Sequence[int]
    pool: BlockPool
    spec: KVCacheSpec
    alignment_tokens: int
    verifier: HitVerifier | None = None
    drop_last: bool = False
    unit_hashes: Sequence[BlockHash] | None = None
    """The request's hashes at the hash unit (``alignment_tokens``) when hits may end inside a
    block (``KVCacheConfig.partial_block_hits``; types with ``fine_grained_hits``)."""

    def lookup(self, index: int) -> list[KVCacheBlock] | None:
        """The cached block at block ``index`` in every group, or ``None`` (a miss in any group,
        or, in verify mode, a block whose prefix is not the request's)."""
        found = self.pool.get_cached_block(self.block_hashes[index], self.group_ids)
        verifier = self.verifier
        if found is None or verifier is None:
            return found
        bs = self.spec.block_size
        for block in found:
            if not verifier.matches(block.prefix_node, index, bs):
                self.pool.num_rejected_hits += 1
                return None
        return found

    def lookup_unit(self, index: int) -> list[KVCacheBlock] | None:
        """The block cached under the request's hash at hash unit ``index`` (a full block's
        hash at a block boundary, else a partial entry) in every group, or ``None``."""
        assert self.unit_hashes is not None
        return self.pool.get_cached_block(self.unit_hashes[index], self.group_ids)


# Custom attention types (KVCacheManager(manager_classes=...)) subclass these outside the
# compiled build: allowed, and their overrides are honoured.
@mypyc_attr(allow_interpreted_subclasses=True)
class SingleTypeKVCacheManager:
    """Block tables of one group.  Subclasses set the attention type's rules."""

    allows_null_blocks: ClassVar[bool] = False
    """Whether block lists may hold the null block (as a leading run)."""

    releases_blocks: ClassVar[bool] = False
    """Whether ``get_num_skipped_tokens`` can be non-zero (blocks leave as a request advances)."""

    downward_closed_hits: ClassVar[bool] = False
    """Whether every shorter aligned prefix of a hit is itself a hit (full attention), so a
    hybrid search can bound everything else by this type's hit and just trim it later."""

    null_gaps: ClassVar[bool] = False
    """Whether null positions may also lie between real blocks (Mamba "align": only the
    running state and its source are real), not only as a leading run."""

    counts_own_growth: ClassVar[bool] = False
    """Whether the coordinator must ask the type for every allocation's count over the main
    model's tokens (``count_state_blocks``) instead of counting missing positions itself:
    types whose tables grow by fewer blocks than positions (Mamba "align")."""

    max_table_blocks: ClassVar[int | None] = None
    """The most blocks a request's table of this type ever holds, whatever its length (a
    circular buffer: 1); ``None``: its tokens decide."""

    fine_grained_hits: ClassVar[bool] = False
    """Whether the type finds hits ending inside a block (every hash unit) under
    ``KVCacheConfig.partial_block_hits`` (vLLM's ``supports_fine_grained_hash_lookup``: full
    attention and Mamba)."""

    def __init__(self, spec: KVCacheSpec, group_id: int, ctx: ManagerContext) -> None:
        self.spec = spec
        self.block_size = spec.block_size
        self.pool = ctx.pool
        self.group_id = group_id
        # The attention type's rules that the spec states (one place for each rule):
        # whether the group holds the encoder output (sized by ``num_encoder_tokens``, which a
        # scheduler passes once, at admission) instead of the decoder's tokens, and whether a
        # hit drops its last block under EAGLE (``HitQuery.drop_last``; a recurrent state keeps
        # its hit whole: the draft model has no such layer, so it gets no look-ahead margin).
        self.uses_encoder_tokens: bool = spec.reads_encoder
        self.drops_eagle_block: bool = not spec.holds_state
        # Scratch groups (``spec.prefix_cacheable`` false) are never cached nor hit.
        self.enable_caching = ctx.enable_caching and spec.prefix_cacheable
        self.hash_block_size = ctx.hash_block_size
        self.alignment_tokens = ctx.alignment_tokens
        # Where a prompt's replay boundaries lie (vLLM: the scheduler block, also when hits
        # may end on any hash unit).
        self.replay_alignment = ctx.scheduler_alignment or ctx.alignment_tokens
        # EAGLE: whether this group's hits drop their last block (``use_eagle``), and whether
        # any group's do (``any_eagle``: the prompt's replay boundaries follow it, as vLLM's).
        self.any_eagle = ctx.use_eagle
        ids = ctx.eagle_group_ids
        self.use_eagle = ctx.use_eagle and (ids is None or group_id in ids)
        self.null_block = ctx.pool.null_block
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_block: dict[str, int] = {}
        self.prefix_chains = ctx.prefix_chains  # verify mode: the exact prefix of cached blocks
        # Whether cache_blocks may register something although no block became full.
        self.caches_partial_tail = (self.registers_partial_tail and self.enable_caching
                                    and self.block_size != self.hash_block_size)
        # Whether cache_blocks ends with the type's _after_caching (Mamba, which sets it in its
        # __init__: states cached this step, checkpoints, hand-offs).  A flag, not a call: the
        # empty base hook costs ~60 ns of every caching step in pure Python.  An instance
        # attribute, not a class one: the compiled build reads a class attribute by a generic
        # lookup, ~140 instructions of every caching step (BENCHMARKS.md, issue 37's compiled
        # residual).
        self.follows_caching = False
        # Block copies recorded and not yet taken (KVCacheManager.take_block_copies): a
        # copy-on-write's (source, destination) pairs, each endpoint holding one withheld
        # reference until the step that runs the copy has been processed.
        self.pending_copies: list[tuple[KVCacheBlock, KVCacheBlock]] = []
        # Partial-block hits (KVCacheConfig.partial_block_hits, types with fine_grained_hits):
        # per request whose hit ends inside a block, that block's table index and the shared
        # block, copied on write into a fresh block by the request's next allocation.
        self.partial_hits = ctx.partial_block_hits and self.fine_grained_hits
        self.partial_hit_reqs: dict[str, tuple[int, KVCacheBlock]] = {}
        self.withheld = ctx.withheld
        # Tokens past the slots a request's table also covers (Mamba "none" with speculative
        # state blocks: ``num_speculative_blocks * block_size``); the type's counts and
        # allocations add them, and so does the coordinator where it counts inline.
        self.extra_slots = 0
        # Blocks a table may hold past the positions of its tokens (MambaSpec's speculative
        # state blocks); 0 for every other type.
        self.num_speculative_blocks = 0

    # -- the attention type's rules ---------------------------------------------------------------
    @classmethod
    def find_longest_cache_hit(cls, query: HitQuery) -> tuple[HitBlocks, int]:
        """The longest prefix hit of at most ``query.max_length`` tokens, common to the query's
        groups.  Returns one block list per group (positions the type does not need hold the null
        block) and the hit length in tokens, a multiple of ``query.alignment_tokens``.

        Every position the first token after the hit attends to must be a real cached block of
        the request's own prefix: a hit that would leave such a position null is never returned.
        """
        raise NotImplementedError

    registers_partial_tail: ClassVar[bool] = False
    """Whether the type registers the prompt's last hash boundary inside a block as a partial
    entry when its blocks are larger than the hash block (full attention, as vLLM)."""

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Leading tokens whose KV the request no longer keeps (0: keep everything)."""
        return 0

    def get_num_unread_tokens(self, num_computed_tokens: int) -> int:
        """Leading tokens whose KV the next token does not read: the skipped ones, unless the
        type keeps some it does not read (a window's ``extra_retained_tokens``); a prefix hit
        may hold the null block there."""
        return self.get_num_skipped_tokens(num_computed_tokens)

    def cache_mask(self, request: KVRequest, start_block: int,
                   end_block: int) -> list[bool] | None:
        """Which of the request's newly full blocks ``[start_block, end_block)`` to put in the
        prefix cache (``None``: all).  Types whose hits only use some blocks keep the others
        out."""
        return None

    # -- accounting -------------------------------------------------------------------------------
    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int,
                                   new_computed_blocks: Sequence[KVCacheBlock],
                                   total_computed_tokens: int, max_blocks: int | None = None) -> int:
        """Free blocks this request needs to have slots for ``num_tokens`` tokens, counting the
        evictable (free but cached) hit blocks it is about to take out of the free queue.
        ``max_blocks`` caps the blocks the request can hold at once (admission checks of types
        that release blocks as they go)."""
        num_required = -(-num_tokens // self.block_size)  # cdiv, inlined (hot)
        if max_blocks is not None and num_required > max_blocks:
            num_required = max_blocks
        blocks = self.req_to_blocks.get(request_id)
        if blocks:  # running: no new hits, only growth
            return max(num_required - len(blocks), 0)
        num_skipped = self.get_num_skipped_tokens(total_computed_tokens) // self.block_size
        num_new = max(num_required - max(num_skipped, len(new_computed_blocks)), 0)
        evictable = 0
        # Hit blocks that are free leave the free queue (the null block reads ref_cnt 0).
        for block in (islice(new_computed_blocks, num_skipped, None) if num_skipped
                      else new_computed_blocks):
            if block.ref_cnt == 0 and not block.is_null:
                evictable += 1
        return num_new + evictable

    shortfall: int = 0
    """(``counts_own_growth`` types) blocks the latest recorded count left out that the
    allocation takes anyway; vLLM's decision uses the count, kvcore also needs these free."""

    def count_state_blocks(self, request_id: str, num_tokens: int,
                           new_computed_blocks: Sequence[KVCacheBlock], total_computed_tokens: int,
                           prefill_end: int, record: bool) -> int:
        """``get_num_blocks_to_allocate`` for ``counts_own_growth`` types, which also need where
        the prompt ends (``prefill_end``) and whether the count precedes a real allocation
        (``record``: the type may remember what that allocation reserves)."""
        return self.get_num_blocks_to_allocate(request_id, num_tokens, new_computed_blocks,
                                               total_computed_tokens)

    def get_num_freeable_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> int:
        """Blocks ``remove_skipped_blocks`` would return to the free queue (without doing it)."""
        num_skipped = self.get_num_skipped_tokens(num_computed_tokens) // self.block_size
        blocks = self.req_to_blocks.get(request_id)
        if num_skipped <= 0 or not blocks:
            return 0
        n = 0
        for i in range(min(num_skipped, len(blocks)) - 1, -1, -1):
            block = blocks[i]
            if block.is_null:
                break
            if block.ref_cnt == 1:
                n += 1
        return n

    def cow_blocks(self, request_id: str, new_computed_blocks: Sequence[KVCacheBlock],
                   num_local_computed_tokens: int) -> int:
        """The block a partial-block hit's copy-on-write takes on admission (1 when the
        request's local hit ends inside one of this group's blocks), counted on top of
        ``get_num_blocks_to_allocate`` (vLLM reserves it in that count)."""
        if (self.partial_hits and new_computed_blocks
                and num_local_computed_tokens % self.block_size):
            return 1
        return 0

    # -- mutation ---------------------------------------------------------------------------------
    def note_partial_hit(self, request_id: str, new_computed_blocks: Sequence[KVCacheBlock],
                         num_local_computed_tokens: int, num_total_computed_tokens: int) -> None:
        """After ``add_computed_blocks``: a local hit ending inside a block (``cow_blocks``)
        whose shared block the request took (not skipped: the tokens computed elsewhere after
        it may leave it behind, as vLLM) records that block for the copy-on-write of the next
        allocation, and the request's cached blocks stop before it (its private copy is
        cached once full)."""
        num_skipped = self.get_num_skipped_tokens(num_total_computed_tokens) // self.block_size
        if num_skipped >= len(new_computed_blocks):
            return
        if self.cow_blocks(request_id, new_computed_blocks, num_local_computed_tokens):
            index = num_local_computed_tokens // self.block_size
            self.partial_hit_reqs[request_id] = (index, new_computed_blocks[-1])
            self.num_cached_block[request_id] = index

    def copy_on_write(self, request_id: str, index: int, source: KVCacheBlock,
                      copy: KVCacheBlock) -> None:
        """Put the fresh ``copy`` in place of the shared ``source`` at table ``index`` and record
        the block copy ``source -> copy``: the request's reference on ``source`` and one more on
        ``copy`` stay withheld until the step that runs the copy has been processed
        (``KVCacheManager.take_block_copies``), so neither endpoint is reused before."""
        blocks = self.req_to_blocks[request_id]
        if blocks[index] is not source or source.is_null or source.ref_cnt <= 0:
            raise AssertionError(f"copy-on-write of request {request_id!r}: table position "
                                 f"{index} does not hold the shared block {source.block_id}")
        blocks[index] = copy
        self.record_block_copy(source, copy, copy)

    def record_block_copy(self, source: KVCacheBlock, copy: KVCacheBlock,
                          pinned: KVCacheBlock) -> None:
        """Record the block copy ``source -> copy`` with both endpoints withheld until its step
        has been processed, taking one more reference on ``pinned`` (the endpoint that no table
        holds a reference for: the copy on a copy-on-write, the source when a producer hands
        its entry to the copy and writes on in the source)."""
        self.pending_copies.append((source, copy))
        self.pool.pin([pinned])
        withheld = self.withheld
        for block in (source, copy):
            withheld[block.block_id] = withheld.get(block.block_id, 0) + 1

    def add_computed_blocks(self, request_id: str, new_computed_blocks: Sequence[KVCacheBlock],
                            num_total_computed_tokens: int) -> None:
        """Start a request's block list with its prefix hit: touch the hit blocks (null-padding
        the positions the type skips) and mark them cached."""
        num_skipped = self.get_num_skipped_tokens(num_total_computed_tokens) // self.block_size
        hits = new_computed_blocks[num_skipped:] if num_skipped else new_computed_blocks
        if hits:
            self.pool.touch(hits, trusted=True)  # checked by KVCacheManager.allocate_slots
        blocks = [self.null_block] * num_skipped
        blocks.extend(hits)
        self.req_to_blocks[request_id] = blocks
        self.num_cached_block[request_id] = len(blocks)

    def allocate_external_computed_blocks(self, request_id: str, num_local_computed_tokens: int,
                                          num_external_computed_tokens: int) -> None:
        """Give tokens computed elsewhere (a KV connector) fresh blocks, except those already
        outside the attention window."""
        total = num_local_computed_tokens + num_external_computed_tokens
        num_skipped_tokens = self.get_num_skipped_tokens(total)
        if num_skipped_tokens > 0:
            num_external_computed_tokens = min(total - num_skipped_tokens,
                                               num_external_computed_tokens)
        if num_external_computed_tokens <= 0:
            return
        blocks = self.req_to_blocks.setdefault(request_id, [])
        num_new = cdiv(total, self.block_size) - len(blocks)
        if num_new > 0:
            blocks.extend(self.pool.get_new_blocks(num_new))

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[KVCacheBlock]:
        """Grow the request's list to ``cdiv(num_tokens, block_size)`` blocks; return the new ones
        (first the copy of a partial-block hit's shared tail, see ``note_partial_hit``)."""
        if self.partial_hit_reqs and request_id in self.partial_hit_reqs:
            return self._allocate_with_copy(request_id, num_tokens)
        blocks = self.req_to_blocks.get(request_id)
        if blocks is None:
            blocks = self.req_to_blocks[request_id] = []
        num_new = -(-num_tokens // self.block_size) - len(blocks)  # cdiv, inlined (hot)
        if num_new <= 0:
            return []
        new = self.pool.get_new_blocks(num_new)
        blocks.extend(new)
        return new

    def _allocate_with_copy(self, request_id: str, num_tokens: int) -> list[KVCacheBlock]:
        """``allocate_new_blocks`` of a request whose hit's shared tail is copied on write."""
        index, source = self.partial_hit_reqs.pop(request_id)
        copy = self.pool.get_new_blocks(1)[0]
        self.copy_on_write(request_id, index, source, copy)
        return [copy, *SingleTypeKVCacheManager.allocate_new_blocks(self, request_id,
                                                                    num_tokens)]

    def cache_blocks(self, request: RequestLike, num_tokens: int) -> None:
        """Put the request's blocks that are full and hashed within its first ``num_tokens``
        tokens into the prefix cache (only the ones not cached yet; with lookahead hashes a
        block is hashed once the tokens after it exist), then register its partial prompt tail
        if the type does (``caches_partial_tail``)."""
        rid = request.request_id
        num_cached = self.num_cached_block.get(rid, 0)
        num_hashed = len(request.block_hashes) * self.hash_block_size
        num_full = (num_tokens if num_tokens < num_hashed else num_hashed) // self.block_size
        if num_cached < num_full:
            hashes = hashes_at(request.block_hashes, self.hash_block_size, self.block_size)
            chains = self.prefix_chains
            nodes = None if chains is None else chains.nodes(request, self.block_size, num_full)
            self.pool.cache_full_blocks(request, self.req_to_blocks[rid], num_cached, num_full,
                                        self.block_size, self.group_id, hashes,
                                        block_mask=self.cache_mask(request, num_cached,
                                                                   num_full),
                                        prefix_nodes=nodes, trusted=True)
            self.num_cached_block[rid] = num_full
        if self.caches_partial_tail:
            self.cache_partial_tail(request, num_tokens)
        if self.follows_caching:
            self._after_caching(request, num_tokens, num_cached)

    def _after_caching(self, request: RequestLike, num_tokens: int, num_cached_before: int) -> None:
        """Called last by ``cache_blocks`` when the type ``follows_caching``, with how many of
        the request's blocks were cached before it: types with per-step or hand-off state
        (Mamba) record the newly cached blocks here."""

    def cache_partial_tail(self, request: KVRequest, num_tokens: int) -> None:
        """Register the prompt's last hash boundary inside a block as a partial entry (types with
        ``registers_partial_tail``; see ``BlockPool.cache_partial_block``)."""

    def uncache_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Drop the request's blocks holding tokens at or after ``num_computed_tokens`` from the
        prefix cache and move its cached watermark back to match."""
        blocks = self.req_to_blocks.get(request_id)
        if not blocks:
            return
        start = num_computed_tokens // self.block_size
        stale = [b.block_id for b in blocks[start:] if not b.is_null and b.block_hash is not None]
        if stale:
            self.pool.evict_blocks(stale)
        if self.num_cached_block.get(request_id, 0) > start:
            self.num_cached_block[request_id] = start

    def first_token_in(self, request_id: str, block_ids: Collection[int]) -> int | None:
        """The position of the first of the request's tokens whose KV this group holds in one of
        ``block_ids`` (the start of the first such block; 0 when the group holds no token of the
        request's own, as cross attention's encoder output), or ``None``."""
        for i, block in enumerate(self.req_to_blocks.get(request_id, ())):
            if not block.is_null and block.block_id in block_ids:
                return 0 if self.uses_encoder_tokens else i * self.block_size
        return None

    def can_resume(self, request_id: str, num_tokens: int) -> bool:
        """Whether the request can go on from ``num_tokens`` computed tokens after its later
        KV turned out unwritten (a failed load): its table holds a real block at every position
        the token at ``num_tokens`` reads and at every position after those (written again).  A
        recurrent state only exists for the request's latest position: never."""
        if self.uses_encoder_tokens:
            return True  # the encoder output does not depend on the decoder's position
        if self.spec.holds_state:
            return False
        needed = self.spec.needed_positions(num_tokens)
        first = needed.start if needed else num_tokens
        blocks = self.req_to_blocks.get(request_id, ())
        return all(not b.is_null for b in blocks[first // self.block_size:])

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Release the blocks wholly outside the attention window, replacing them with the null
        block.  They are released newest first (vLLM's order), so among them the oldest is
        evicted last."""
        num_skipped_tokens = self.get_num_skipped_tokens(num_computed_tokens)
        if num_skipped_tokens <= 0:
            return
        blocks = self.req_to_blocks.get(request_id)
        if not blocks:
            return
        null = self.null_block
        freed: list[KVCacheBlock] = []
        for i in range(min(num_skipped_tokens // self.block_size, len(blocks)) - 1, -1, -1):
            block = blocks[i]
            if block.is_null:
                break
            freed.append(block)
            blocks[i] = null
        if freed:
            self.pool.free_blocks(freed, trusted=True)

    def free(self, request_id: str) -> None:
        """Release all of the request's blocks, tail first (so its prefix is evicted last)."""
        blocks = self.pop_blocks(request_id)
        if blocks:
            # A reversed copy: a caller may still hold the list (get_blocks) and read it in order.
            self.pool.free_blocks(blocks[::-1], trusted=True)

    def pop_blocks(self, request_id: str) -> list[KVCacheBlock]:
        """Forget the request and hand back its block list (allocation order, null positions
        included) without releasing anything: the caller owns its references now."""
        self.num_cached_block.pop(request_id, None)
        if self.partial_hit_reqs:
            self.partial_hit_reqs.pop(request_id, None)
        return self.req_to_blocks.pop(request_id, None) or []

    def new_step(self) -> None:
        """A scheduling step ended (types with per-step state reset it here)."""

    def step_state(self) -> frozenset[BlockHash]:
        """The per-step state ``new_step`` resets (for snapshots; empty for most types)."""
        return frozenset()

    def get_num_common_prefix_blocks(self, request_id: str, num_running_requests: int) -> int:
        """Leading blocks of this request that every running request shares."""
        n = 0
        for block in self.req_to_blocks.get(request_id, ()):
            if block.ref_cnt != num_running_requests:
                break
            n += 1
        return n
