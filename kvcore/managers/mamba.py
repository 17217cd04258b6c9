"""Mamba / linear-attention state: block ``i`` holds the state after token ``(i+1)*block_size``,
so only the latest block matters.  A hit is the right-most cached block (earlier positions null);
older blocks are released as the request advances.

A state cached during the current step is not written yet (the scan produces it at the end of
the step), so another request cannot use a hit with that hash until ``new_step()`` — not even an
older block cached under the same hash, as vLLM keys this by hash.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvcore._mypyc import mypyc_attr
from kvcore.errors import UnsupportedFeatureError
from kvcore.hashing import hashes_at
from kvcore.managers.base import HitQuery, ManagerContext, SingleTypeKVCacheManager
from kvcore.managers.sliding_window import replay_boundaries
from kvcore.request import RequestLike
from kvcore.specs import KVCacheSpec, MambaSpec
from kvcore.types import BlockHash, HitBlocks, KVCacheBlock, KVRequest


@mypyc_attr(allow_interpreted_subclasses=True)  # see SingleTypeKVCacheManager
class MambaManager(SingleTypeKVCacheManager):
    allows_null_blocks = True
    releases_blocks = True
    # (A hit is kept whole under EAGLE: MambaSpec.holds_state, see drops_eagle_block.)

    def __init__(self, spec: KVCacheSpec, group_id: int, ctx: ManagerContext) -> None:
        super().__init__(spec, group_id, ctx)
        self.follows_caching = True  # _after_caching records the states cached this step
        self.cached_this_step: set[BlockHash] = set()  # hashes cached since new_step()
        assert isinstance(spec, MambaSpec)
        # Speculative state blocks (MTP/EAGLE drafting): "none" mode reaches that many blocks
        # further (extra_slots, which the coordinator adds where it counts inline); "align"
        # mode keeps them after the running state (MambaAlignManager).
        self.num_speculative_blocks = spec.num_speculative_blocks
        if spec.mamba_cache_mode != "align":
            self.extra_slots = spec.num_speculative_blocks * spec.block_size

    @classmethod
    def find_longest_cache_hit(cls, query: HitQuery) -> tuple[HitBlocks, int]:
        bs = query.spec.block_size
        alignment = query.alignment_tokens
        null = query.pool.null_block
        units = query.unit_hashes
        if units is not None and alignment < bs:
            # Partial-block hits: the right-most hash boundary with a cached state (a full
            # block's at a block boundary, else a partial entry), in the block holding it.
            scale = bs // alignment
            for j in range(min(query.max_length // alignment, len(units)) - 1, -1, -1):
                found = query.lookup_unit(j)
                if found is not None:
                    i = j // scale
                    return [[null] * i + [block] for block in found], (j + 1) * alignment
            return [[] for _ in query.group_ids], 0
        for i in range(min(query.max_length // bs, len(query.block_hashes)) - 1, -1, -1):
            if bs != alignment and (i + 1) * bs % alignment:
                continue
            found = query.lookup(i)
            if found is None:
                continue
            return [[null] * i + [block] for block in found], (i + 1) * bs
        return [[] for _ in query.group_ids], 0

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return max(0, num_computed_tokens - 1)

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int,
                                   new_computed_blocks: Sequence[KVCacheBlock],
                                   total_computed_tokens: int, max_blocks: int | None = None) -> int:
        if new_computed_blocks and new_computed_blocks[-1].block_hash in self.cached_this_step:
            # A state with this hash is still being computed (by whichever block): make the
            # allocation impossible this step, as vLLM does.
            return self.pool.num_blocks + 1
        return super().get_num_blocks_to_allocate(request_id, num_tokens + self.extra_slots,
                                                  new_computed_blocks, total_computed_tokens,
                                                  max_blocks)

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[KVCacheBlock]:
        """Grow the table to ``num_tokens`` slots plus the speculative state blocks."""
        return super().allocate_new_blocks(request_id, num_tokens + self.extra_slots)

    def _after_caching(self, request: RequestLike, num_tokens: int, num_cached_before: int) -> None:
        """States cached now are not written until the step ends (``cached_this_step``)."""
        before = num_cached_before
        after = self.num_cached_block.get(request.request_id, 0)
        blocks = self.req_to_blocks.get(request.request_id, [])
        for block in blocks[before:after]:
            if not block.is_null and block.block_hash is not None:
                self.cached_this_step.add(block.block_hash)

    def new_step(self) -> None:
        self.cached_this_step.clear()

    def step_state(self) -> frozenset[BlockHash]:
        return frozenset(self.cached_this_step)


def checkpoint_position(num_tokens: int, unit: int, eagle: bool = False) -> int:
    """Where a request's prompt state is kept (vLLM's ``get_mamba_prefill_checkpoint_position``):
    the last multiple of ``unit`` strictly before ``num_tokens`` (0 if none), one token short of
    its end, so a repeat of the prompt still computes its last token; under EAGLE (``eagle``)
    one ``unit`` below the last multiple at or before ``num_tokens``: EAGLE's replay boundary,
    where a hit lands once its last block is dropped."""
    if eagle:
        return max(num_tokens // unit * unit - unit, 0)
    return max((num_tokens - 1) // unit * unit, 0)


@mypyc_attr(allow_interpreted_subclasses=True)  # see SingleTypeKVCacheManager
class MambaAlignManager(MambaManager):
    """vLLM's Mamba ``"align"`` mode: a request's table is position-indexed (block ``i`` would
    hold the state after ``(i+1)*block_size`` tokens) but holds only the running state block,
    the previous one (the kernel copies the state from it; released once the step that read
    it is processed) and, on the prompt's last chunk with ``num_prefill_checkpoint_blocks``,
    the checkpoint block for the prompt's last hit-aligned boundary, in that boundary's slot
    (the hit alignment, the lcm of every group's block size, may span several of this group's
    blocks); every other position is null.
    With ``num_speculative_blocks`` (MTP/EAGLE) that many blocks follow the running state's
    (``_allocate_with_speculative``: vLLM's relocation); under EAGLE (``use_eagle``)
    checkpoints sit at EAGLE's replay boundary (``checkpoint_position``).
    A step therefore needs at most one new block (two with a checkpoint; a first allocation
    also the speculative ones) whatever its length,
    which is why the coordinator asks this type for its count on every allocation
    (``counts_own_growth``), over the main model's tokens (draft tokens never reach a state
    layer).  Each newly cached state is also handed to KV connectors as a boundary-state
    offload (``take_boundary_state_offloads``).
    """

    null_gaps = True
    counts_own_growth = True
    fine_grained_hits = True

    def __init__(self, spec: KVCacheSpec, group_id: int, ctx: ManagerContext) -> None:
        super().__init__(spec, group_id, ctx)
        assert isinstance(spec, MambaSpec)
        self.has_checkpoints = spec.num_prefill_checkpoint_blocks > 0
        if (self.num_speculative_blocks and self.has_checkpoints and not self.partial_hits
                and self.alignment_tokens != self.block_size):
            # vLLM's layout puts the checkpoint right before the running state; with a hit
            # alignment larger than the block it lies further back, which the speculative
            # blocks' relocation cannot follow.
            raise UnsupportedFeatureError(
                f"speculative Mamba state blocks ({self.num_speculative_blocks}) with a prefill "
                f"checkpoint in group {group_id}, whose {self.block_size}-token blocks are "
                f"smaller than the {self.alignment_tokens}-token hit alignment")
        # Partial-block hits: per request that registered its prompt's last hash boundary
        # inside its running state block (a producer), that block and the boundary.
        self.producer_tails: dict[str, tuple[KVCacheBlock, int]] = {}
        # EAGLE/MTP drafting: checkpoints move to EAGLE's replay boundary (checkpoint_position).
        self.eagle_checkpoints = ctx.use_eagle
        self.junction_tail = ctx.eagle_junction_tail and ctx.use_eagle
        # Requests that went through allocate_new_blocks since admission: their tables end
        # with the speculative blocks (vLLM's allocated-block requests).
        self.allocated: set[str] = set()
        self.checkpoint_alignment = spec.prefill_checkpoint_alignment
        # Sparse retention (KVCacheConfig.prefix_cache_retention_interval; vLLM's default 0):
        # only states a later request can resume at are cached.
        self.retention_interval = ctx.retention_interval
        self.shared_prefix_boundaries = ctx.shared_prefix_boundaries
        self.recache_prompt_boundary = ctx.mamba_recache_prompt_boundary
        self.shared_prefix_checkpoint = ctx.mamba_shared_prefix_checkpoint
        # cache_blocks has work even when no block filled (checkpoints, the 0.32 re-mark).
        self.caches_partial_tail = self.enable_caching
        # Per request: the block the running state was copied from (released once the step
        # that read it is processed), how far the table has been released, and the checkpoint
        # (token position, table index) the current allocation reserved.
        self.last_state_block_idx: dict[str, int] = {}
        self.num_retired_blocks: dict[str, int] = {}
        self.checkpoints: dict[str, tuple[int, int]] = {}
        # The checkpoint the latest recorded count reserves (request id, reservation or None),
        # committed to ``checkpoints`` by the allocation that follows it: a failed allocation
        # leaves ``checkpoints`` as it was.
        self._staged: tuple[str, tuple[int, int] | None] | None = None
        # Blocks the latest recorded count leaves out that the allocation takes anyway (see
        # count_state_blocks): the coordinator checks them against the free blocks.
        self.shortfall = 0
        # (request id, group id, block, boundary tokens) of each state cached since the last
        # take_boundary_state_offloads().
        self.pending_offloads: list[tuple[str, int, KVCacheBlock, int]] = []

    # -- counting ---------------------------------------------------------------------------------
    def _needs_checkpoint(self, request_id: str, blocks: Sequence[KVCacheBlock],
                          query_start: int, query_end: int, position: int,
                          prefill_end: int) -> bool:
        """Whether this chunk exports the checkpoint state at ``position`` (a multiple of the
        hit alignment, so of the block size) from inside the step, into table slot
        ``position // block_size - 1``: the slot that holds the state at ``position``, wholly
        inside the chunk (after the slot its initial state is read from, at or after the end
        of the table ``blocks``) and before the running state's slot.  That is vLLM's
        ``cdiv(query_end, mamba_block_size) - 2`` when the hit alignment is the Mamba block
        size (vLLM's align mode sets them equal); with a larger alignment (another group's
        larger blocks) the slot is further back and null positions lie between the two.  With
        speculative blocks the slot may also lie inside the table: at a null position, or
        among the speculative blocks of a request allocated before (that block then takes the
        checkpoint)."""
        alignment = self.checkpoint_alignment
        if not self.has_checkpoints or alignment is None or query_end < prefill_end:
            return False
        index = self._checkpoint_index(position, query_end)
        return (index >= 0
                and query_start % self.hash_block_size == 0
                and index > (query_start - 1) // self.block_size
                and query_start + self.hash_block_size <= position
                and query_start < position < query_end
                and (position - query_start) % alignment == 0
                and (index >= len(blocks)
                     or (self.num_speculative_blocks > 0
                         and (blocks[index].is_null
                              or (request_id in self.allocated
                                  and index >= len(blocks) - self.num_speculative_blocks)))))

    def _checkpoint_index(self, position: int, query_end: int) -> int:
        """The table slot a checkpoint at ``position`` goes to: the slot holding that state
        (``position // block_size - 1``, kvcore's layout for hit alignments of whole blocks);
        under partial-block hits vLLM's slot, the one before the chunk's running state
        (``cdiv(query_end, block_size) - 2``), whatever unit the position ends on."""
        if self.partial_hits:
            return -(-query_end // self.block_size) - 2
        return position // self.block_size - 1

    def count_state_blocks(self, request_id: str, num_tokens: int,
                           new_computed_blocks: Sequence[KVCacheBlock], total_computed_tokens: int,
                           prefill_end: int, record: bool) -> int:
        """Free blocks the request needs for ``num_tokens`` (main-model) tokens: at most one
        state block, plus the checkpoint block when this chunk ends the prompt, plus evictable
        hit blocks.  ``record`` (a real allocation, not an admission estimate) stages the
        checkpoint for ``allocate_new_blocks`` to commit (then ``cache_blocks`` keys it); vLLM
        records it in the count itself, so a failed allocation leaves a reservation there that
        no later call reads before it is replaced."""
        if new_computed_blocks and new_computed_blocks[-1].block_hash in self.cached_this_step:
            return self.pool.num_blocks + 1  # that state is still being computed: not this step
        if self.retention_interval != 0:
            prefill_end = 0  # dense or interval retention: every chunk may export a checkpoint
        bs = self.block_size
        spec = self.num_speculative_blocks
        blocks = self.req_to_blocks.get(request_id, ())
        # The running state's block when the table grows (none when the table already covers
        # the tokens: it may be longer, never a negative count that hides another group's
        # need), plus the checkpoint's, plus the speculative blocks a first allocation adds.
        num_new = -(-num_tokens // bs) + spec - len(new_computed_blocks) - len(blocks)
        position = checkpoint_position(num_tokens, self.alignment_tokens, self.eagle_checkpoints)
        if not self._needs_checkpoint(request_id, blocks, total_computed_tokens, num_tokens,
                                      position, prefill_end):
            position = 0
        if num_new > 0:
            cap = 2 if position else 1
            if spec and request_id not in self.allocated:
                cap += spec
            if num_new > cap:
                num_new = cap
        else:
            num_new = 0
        if self.partial_hit_reqs and blocks and request_id in self.partial_hit_reqs:
            num_new += 1  # a producer's copy of its partial tail (admission: cow_blocks)
        if record:
            self._staged = (request_id, (position, self._checkpoint_index(position, num_tokens))
                                        if position else None)
        hit_tokens = len(new_computed_blocks) * bs
        if record:
            self.shortfall = 0
        if record and not blocks and total_computed_tokens > hit_tokens:
            # Tokens computed elsewhere (a KV connector) first get every position up to them
            # (allocate_external_computed_blocks), then the state block: vLLM counts only the
            # latter (its count, returned here, decides with its watermark and reservations),
            # and fails inside the allocation when the pool is short of the rest; kvcore
            # records that rest (``shortfall``) for the coordinator to check against the free
            # blocks, so it refuses exactly where vLLM's allocation would fail.
            held = -(-total_computed_tokens // bs)
            required = -(-num_tokens // bs)
            grown = 0
            if required + spec > held or position:
                grown = max(required + spec - max(held, required - 1 - (1 if position else 0)),
                            0)
            # (Positions before the last computed token are null: only the last gets a block.)
            exact = held - max((total_computed_tokens - 1) // bs, len(new_computed_blocks)) + grown
            if exact > num_new:
                self.shortfall = exact - max(num_new, 0)
        evictable = 0
        for block in new_computed_blocks:
            if block.ref_cnt == 0 and not block.is_null:
                evictable += 1
        return num_new + evictable

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int,
                                   new_computed_blocks: Sequence[KVCacheBlock],
                                   total_computed_tokens: int, max_blocks: int | None = None) -> int:
        return self.count_state_blocks(request_id, num_tokens, new_computed_blocks,
                                       total_computed_tokens, 0, False)

    def steady_step_fits(self, request: RequestLike, num_tokens: int,
                         num_tokens_to_cache: int | None) -> bool:
        """Whether a step of running ``request`` to ``num_tokens`` (main-model) tokens, caching
        within ``num_tokens_to_cache`` (aligned; ``None``: no caching), takes no block here
        and caches no new state (``KVCacheCoordinator.steady_step``; only without speculative
        blocks or partial-block hits, where the count is then 0 and no checkpoint is due:
        a checkpoint's slot lies past the table's end).  Changes nothing."""
        rid = request.request_id
        blocks = self.req_to_blocks.get(rid)
        if blocks is None or -(-num_tokens // self.block_size) > len(blocks):
            return False
        n = num_tokens_to_cache
        if n is not None and self.enable_caching:
            hashed = len(request.block_hashes) * self.hash_block_size
            if (n if n < hashed else hashed) // self.block_size > self.num_cached_block.get(rid, 0):
                return False
        return True

    def take_steady_step(self, request: RequestLike, num_processed_tokens: int,
                         num_tokens_to_cache: int | None) -> None:
        """The effects of a step ``steady_step_fits`` accepted, as the general path has them:
        the count's staged reservation (none) committed and any old checkpoint dropped, the
        states before the processed tokens' last one released, and (vLLM 0.32's re-mark,
        ``mamba_recache_prompt_boundary``) the prompt's boundary state marked cached this step
        again."""
        rid = request.request_id
        self._staged = None
        self.shortfall = 0
        if self.checkpoints:
            self.checkpoints.pop(rid, None)
        self.remove_skipped_blocks(rid, num_processed_tokens)
        if (num_tokens_to_cache is not None and self.enable_caching
                and self.recache_prompt_boundary):
            self._recache_prompt_boundary(request, num_tokens_to_cache)

    def get_num_freeable_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> int:
        blocks = self.req_to_blocks.get(request_id)
        if not blocks:
            return 0
        return sum(1 for i in self._released_by(request_id, blocks, num_computed_tokens)
                   if blocks[i].ref_cnt == 1)

    # -- mutation ---------------------------------------------------------------------------------
    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[KVCacheBlock]:
        """Grow the table to ``cdiv(num_tokens, block_size)`` positions: the new running state
        block last, null positions before it except, with a checkpoint reserved, the
        checkpoint block at its slot (always past the table's old end and before the last)."""
        staged = self._staged
        if staged is not None and staged[0] == request_id:
            self._staged = None
            if staged[1] is None:
                self.checkpoints.pop(request_id, None)
            else:
                self.checkpoints[request_id] = staged[1]
        blocks = self.req_to_blocks.get(request_id)
        if blocks is None:
            blocks = self.req_to_blocks[request_id] = []
        if self.partial_hits:
            return self._allocate_partial(request_id, blocks, num_tokens)
        if self.num_speculative_blocks:
            return self._allocate_with_speculative(request_id, blocks, num_tokens)
        required = -(-num_tokens // self.block_size)
        prev = len(blocks)
        if required <= prev:  # (a reserved checkpoint lies past the old end: none here)
            return []
        if prev > 0:
            self.last_state_block_idx[request_id] = prev - 1
        null = self.null_block
        checkpoint = self.checkpoints.get(request_id)
        if checkpoint is None:
            if prev < required - 1:
                blocks.extend([null] * (required - 1 - prev))
            blocks.extend(self.pool.get_new_blocks(1))
        else:
            index = checkpoint[1]
            new = self.pool.get_new_blocks(2)  # one call, in table order (vLLM's block ids)
            blocks.extend([null] * (index - prev))
            blocks.append(new[0])
            blocks.extend([null] * (required - 2 - index))
            blocks.append(new[1])
        return blocks[prev:]  # the new positions, null ones included (as vLLM returns them)

    def _allocate_partial(self, request_id: str, blocks: list[KVCacheBlock],
                          num_tokens: int) -> list[KVCacheBlock]:
        """``allocate_new_blocks`` under partial-block hits (vLLM's layout: the running state's
        slot, a reserved checkpoint's in the slot before it, the speculative blocks after it,
        relocated as in ``_allocate_with_speculative``), plus the copy-on-write of a partial
        tail, taken first.  A request admitted on a partial hit gets the copy in place of the
        shared block; a running producer keeps writing its state block (a worker's table only
        grows), so the copy takes over that block's prefix-cache entries
        (``BlockPool.move_block_hashes``) and is filled by the block copy before the step
        overwrites the state."""
        partial = self.partial_hit_reqs.pop(request_id, None)
        allocated = request_id in self.allocated
        self.allocated.add(request_id)
        spec = self.num_speculative_blocks
        checkpoint = int(request_id in self.checkpoints)
        required = -(-num_tokens // self.block_size) + spec
        prev = len(blocks)
        if required <= prev and partial is None and not checkpoint:
            return []
        # The null run stops before the running state's slot, one slot earlier with a
        # checkpoint reserved (_checkpoint_index: the slot before the running state's).
        self._lay_out_state(request_id, blocks, prev, required - spec - 1 - checkpoint,
                            allocated)
        new = self.pool.get_new_blocks(max(required - len(blocks), 0) + (partial is not None))
        out = blocks[prev:]
        if partial is not None:
            index, source = partial
            copy = new.pop(0)
            if allocated:
                if blocks[index] is not source:
                    raise AssertionError(f"request {request_id!r}: its partial tail block "
                                         f"{source.block_id} left table position {index}")
                self.pool.move_block_hashes(source, copy)
                self.record_block_copy(source, copy, source)
                tail = self.producer_tails.pop(request_id, None)
                if tail is not None:
                    self.pending_offloads.append((request_id, self.group_id, copy, tail[1]))
                if copy.block_hash is not None:
                    self.cached_this_step.add(copy.block_hash)  # filled by this step's copy
            else:
                self.copy_on_write(request_id, index, source, copy)
                out = [copy, *out]
        blocks.extend(new)
        out.extend(new)
        return out

    def _lay_out_state(self, request_id: str, blocks: list[KVCacheBlock], prev: int,
                       keep_from: int, allocated: bool) -> None:
        """Record where the request's state sits before this allocation (``prev``: the table's
        length), pad the table with nulls up to ``keep_from``, and move to its end the
        speculative blocks of an earlier allocation that ``keep_from`` has passed (their old
        positions nulled): the layout both speculative paths share (vLLM's)."""
        spec = self.num_speculative_blocks
        if allocated:  # the running state sits before the speculative blocks
            self.last_state_block_idx[request_id] = prev - 1 - spec
        elif prev > 0:  # a hit or loaded tokens: the last block holds the state
            self.last_state_block_idx[request_id] = prev - 1
        null = self.null_block
        if prev < keep_from:
            blocks.extend([null] * (keep_from - prev))
        if allocated:
            for i in range(prev - spec, prev):
                if i >= keep_from:
                    break
                block = blocks[i]
                blocks[i] = null
                blocks.append(block)

    def _allocate_with_speculative(self, request_id: str, blocks: list[KVCacheBlock],
                                   num_tokens: int) -> list[KVCacheBlock]:
        """``allocate_new_blocks`` with ``num_speculative_blocks`` (vLLM's layout): the table
        grows to ``cdiv(num_tokens, block_size) + num_speculative_blocks`` positions, the
        running state's slot followed by the speculative blocks.  Speculative blocks of an
        earlier allocation that the new running state's slot has passed move to the table's
        end, their old positions nulled (in a checkpoint step the one at the checkpoint's slot
        stays: it takes the checkpoint); new blocks fill what is still missing.  Returns the
        table's new positions (null ones and moved blocks included, as vLLM returns them)."""
        spec = self.num_speculative_blocks
        required = -(-num_tokens // self.block_size) + spec
        checkpoint = self.checkpoints.get(request_id)
        if checkpoint is not None and checkpoint[1] != required - spec - 2:
            # The layout has room for a checkpoint only right before the running state's slot.
            # One further back (EAGLE's boundary in a chunk that does not end on a block edge,
            # which vLLM's scheduler never cuts in "align" mode) is not exported; the count
            # included its block, as vLLM's does, so the allocation takes one block fewer.
            del self.checkpoints[request_id]
            checkpoint = None
        has_checkpoint = 0 if checkpoint is None else 1
        prev = len(blocks)
        allocated = request_id in self.allocated
        self.allocated.add(request_id)
        if required <= prev and not has_checkpoint:
            return []
        # (keep_from: the running state's slot, or the checkpoint's before it)
        self._lay_out_state(request_id, blocks, prev, required - spec - 1 - has_checkpoint,
                            allocated)
        num_new = required - len(blocks)
        if num_new > 0:
            blocks.extend(self.pool.get_new_blocks(num_new))
        return blocks[prev:]

    def _released_by(self, request_id: str, blocks: Sequence[KVCacheBlock],
                     num_computed_tokens: int) -> list[int]:
        """Table indices ``remove_skipped_blocks`` releases, in release order."""
        out: list[int] = []
        skipped = num_computed_tokens - 1
        if skipped > 0:
            first = self.num_retired_blocks.get(request_id, 0)
            last = min(skipped // self.block_size, len(blocks))
            out.extend(i for i in range(last - 1, first - 1, -1) if not blocks[i].is_null)
        source = self.last_state_block_idx.get(request_id)
        if (source is not None and source < -(-num_computed_tokens // self.block_size) - 1
                and source not in out and not blocks[source].is_null):
            out.append(source)
        return out

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Release the states before the processed tokens' last one: the table's released
        range (skipping its null gaps, newest first), then the block the running state was
        copied from, once the step that read it is processed."""
        blocks = self.req_to_blocks.get(request_id)
        if not blocks:
            return
        null = self.null_block
        skipped = num_computed_tokens - 1
        if skipped > 0:
            first = self.num_retired_blocks.get(request_id, 0)
            last = min(skipped // self.block_size, len(blocks))
            if first < last:
                freed = []
                for i in range(last - 1, first - 1, -1):
                    if not blocks[i].is_null:
                        freed.append(blocks[i])
                        blocks[i] = null
                if freed:
                    self.pool.free_blocks(freed, trusted=True)
                self.num_retired_blocks[request_id] = last
        source = self.last_state_block_idx.get(request_id)
        if (source is not None and source < -(-num_computed_tokens // self.block_size) - 1
                and not blocks[source].is_null):
            block = blocks[source]
            blocks[source] = null
            self.pool.free_blocks([block], trusted=True)

    def _retained(self, index: int, start_block: int) -> bool:
        """Whether sparse retention keeps the state at table ``index`` by its segment alone."""
        retention = self.retention_interval
        if retention is None:
            return True
        per_segment = retention // self.block_size
        if retention == 0:
            return False
        if per_segment <= 1:
            return True
        return index >= start_block and (index + 1) % per_segment == 0

    def cache_mask(self, request: KVRequest, start_block: int,
                   end_block: int) -> list[bool] | None:
        """Under sparse retention, only the states a later request can resume at: one per
        retention interval, the prompt's replay boundaries (under EAGLE, the aligned blocks
        below a resend's and a longer sibling's match) and the shared prefix the request's
        admission found (with ``eagle_junction_tail``, also one block below it) — vLLM's
        reachable-block mask for Mamba."""
        if self.retention_interval is None:
            return None
        if self.retention_interval and self.retention_interval // self.block_size <= 1:
            return None
        mask = [self._retained(i, start_block) for i in range(start_block, end_block)]
        align = self.alignment_tokens
        # (The replay boundaries follow whether any group drops, as vLLM's.)
        boundaries = list(replay_boundaries(request.num_prompt_tokens, self.replay_alignment,
                                            self.any_eagle))
        shared = self.shared_prefix_boundaries.get(request.request_id, 0)
        if shared:
            boundaries.append(shared)
            if self.junction_tail:  # (as the sliding window's: see ManagerContext)
                boundaries.append(shared - self.block_size)
        for boundary in boundaries:
            index = boundary // align * align // self.block_size - 1
            if start_block <= index < end_block:
                mask[index - start_block] = True
        return mask

    def _after_caching(self, request: RequestLike, num_tokens: int, num_cached_before: int) -> None:
        """After the full states are cached (null positions skipped): key the reserved
        checkpoint block at its boundary, and hand each newly cached state to KV connectors."""
        rid = request.request_id
        before = num_cached_before
        after = self.num_cached_block.get(rid, 0)
        if rid in self.checkpoints:
            if self.partial_hits:
                self._cache_checkpoint_partial(request)
            else:
                self._cache_checkpoint(request)
        elif self.partial_hits:
            self._cache_partial_tail(request, num_tokens)
        elif self.recache_prompt_boundary:
            self._recache_prompt_boundary(request, num_tokens)
        if after > before:
            blocks = self.req_to_blocks[rid]
            for i in range(before, after):
                block = blocks[i]
                if block.is_null or block.block_hash is None:
                    continue
                self.cached_this_step.add(block.block_hash)
                # (A checkpoint re-keyed under partial-block hits offers its own boundary.)
                self.pending_offloads.append((rid, self.group_id, block, self._covered(block, i)))

    def _cache_checkpoint(self, request: RequestLike) -> None:
        """The checkpoint block reserved for this chunk holds the state at its position: a
        transient one (not the prompt's, not retained, not the shared prefix) leaves the cache;
        a kept one is cached there (it normally is already, as a full block)."""
        rid = request.request_id
        position, index = self.checkpoints[rid]
        block = self.req_to_blocks[rid][index]
        if block.is_null:
            return
        kept = (position == checkpoint_position(request.num_prompt_tokens, self.alignment_tokens,
                                                self.eagle_checkpoints)
                or self._retained(index, 0)
                or position == self.shared_prefix_boundaries.get(rid, 0))
        if not kept:
            # Also when it caches nothing: the pool's observer hears of it, as vLLM reports it.
            self.pool.evict_blocks([block.block_id])
            return
        if block.block_hash is not None:
            return
        hashes = hashes_at(request.block_hashes, self.hash_block_size, self.block_size)
        if index >= len(hashes):  # not hashed yet (lookahead hashes wait for later tokens)
            return
        self.pool.cache_full_blocks(request, self.req_to_blocks[rid], index, index + 1,
                                    self.block_size, self.group_id, hashes, trusted=True)
        self.cached_this_step.add(hashes[index])

    def _cache_checkpoint_partial(self, request: RequestLike) -> None:
        """``_cache_checkpoint`` under partial-block hits: the checkpoint block holds the state at
        its position, any hash unit, which replaces every entry the block carries (the block
        cached as a full block earlier in this call holds another state), unless a transient
        one leaves the cache or the block already carries it (vLLM's re-keying)."""
        rid = request.request_id
        position, index = self.checkpoints[rid]
        block = self.req_to_blocks[rid][index]
        retained = False
        if position % self.block_size == 0:
            slot = position // self.block_size - 1
            retained = self._retained(slot, slot)
        kept = (position == checkpoint_position(request.num_prompt_tokens, self.alignment_tokens,
                                                self.eagle_checkpoints)
                or retained or position == self.shared_prefix_boundaries.get(rid, 0))
        if not kept:
            self.pool.evict_blocks([block.block_id])
            return
        if block.is_null or (block.block_hash is not None
                             and self._covered(block, index) == position):
            return
        key = self.pool.cache_partial_block(request, block, position, self.hash_block_size,
                                            self.group_id, replace_existing_hashes=True)
        if key is not None:
            self.cached_this_step.add(key)

    def _covered(self, block: KVCacheBlock, index: int) -> int:
        """How many prefix tokens the entry ``block`` (cached, at table ``index``) is keyed by."""
        covered = self.pool.partial_primary_tokens(block)
        return covered if covered is not None else (index + 1) * self.block_size

    def _cache_partial_tail(self, request: RequestLike, num_tokens: int) -> None:
        """Partial-block hits: a chunk ending at the prompt's last hash boundary (vLLM's Mamba
        partial tail) registers the state block there under that boundary's hash (a partial
        entry when inside the block; the producer then copies it on its next allocation,
        ``_allocate_partial``, before the state moves on), not hittable this step."""
        unit = self.hash_block_size
        rid = request.request_id
        if num_tokens <= 0 or num_tokens % unit:
            return
        if num_tokens != checkpoint_position(request.num_prompt_tokens, unit,
                                             self.eagle_checkpoints) and not (
                # (shared-prefix checkpoints) a prompt chunk ending at the request's junction
                self.shared_prefix_checkpoint
                and num_tokens == self.shared_prefix_boundaries.get(rid, 0)
                and request.num_computed_tokens < num_tokens <= request.num_prompt_tokens):
            return
        index = -(-num_tokens // self.block_size) - 1
        blocks = self.req_to_blocks[rid]
        if index >= len(blocks) or blocks[index].is_null:
            return
        source = blocks[index]
        if (not self.recache_prompt_boundary and source.block_hash is not None
                and self._covered(source, index) == num_tokens):
            # (vLLM 0.33) already keyed at this boundary by a hit or an earlier step: not
            # marked cached this step again (0.32 marks it, mamba_recache_prompt_boundary).
            return
        key = self.pool.cache_partial_block(request, source, num_tokens, unit, self.group_id)
        if key is None:
            return
        if num_tokens % self.block_size:
            self.partial_hit_reqs[rid] = (index, source)
            self.num_cached_block[rid] = index
            self.producer_tails[rid] = (source, num_tokens)
        self.cached_this_step.add(key)

    def _recache_prompt_boundary(self, request: RequestLike, num_tokens: int) -> None:
        """vLLM 0.32: a chunk ending at the prompt's last block boundary before its end marks
        the state there cached this step again, even one cached (or hit) earlier."""
        bs = self.block_size
        if num_tokens <= 0 or num_tokens % bs or num_tokens != checkpoint_position(
                request.num_prompt_tokens, self.hash_block_size, self.eagle_checkpoints):
            return
        blocks = self.req_to_blocks[request.request_id]
        index = num_tokens // bs - 1
        if index < len(blocks):
            h = blocks[index].block_hash
            if h is not None:
                self.cached_this_step.add(h)

    def pop_blocks(self, request_id: str) -> list[KVCacheBlock]:
        self._forget(request_id)
        return super().pop_blocks(request_id)

    def _forget(self, request_id: str) -> None:
        self.allocated.discard(request_id)
        self.last_state_block_idx.pop(request_id, None)
        self.num_retired_blocks.pop(request_id, None)
        self.checkpoints.pop(request_id, None)
        if self.producer_tails:
            self.producer_tails.pop(request_id, None)
        if any(entry[0] == request_id for entry in self.pending_offloads):
            self.pending_offloads = [e for e in self.pending_offloads if e[0] != request_id]

    def finalize_partial_tail(self, request_id: str, num_computed_tokens: int,
                              num_in_flight_tokens: int) -> tuple[int, KVCacheBlock, int] | None:
        """A finishing producer's partial prompt tail (``_cache_partial_tail``) for a KV
        connector, ``(group id, block, boundary tokens)``, when its state block still holds the
        state at the boundary (nothing computed past it, nothing in flight); consumed either
        way (vLLM's ``finalize_partial_tail_offload``).  A tail already copied on write was
        handed off with its copy (``take_boundary_state_offloads``)."""
        tail = self.producer_tails.pop(request_id, None)
        if tail is None or num_in_flight_tokens != 0 or num_computed_tokens != tail[1]:
            return None
        return self.group_id, tail[0], tail[1]

    def take_boundary_state_offloads(self) -> list[tuple[str, int, KVCacheBlock, int]]:
        """The states cached since the last call: ``(request id, group id, block, boundary
        tokens)`` each, for a KV connector to offload (vLLM's hand-off; a request that is freed
        first takes its entries with it)."""
        out = self.pending_offloads
        self.pending_offloads = []
        return out
