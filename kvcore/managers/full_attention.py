"""Full attention: a hit is the longest run of leading cached blocks; nothing is freed early."""

from __future__ import annotations

from itertools import islice

from kvcore._mypyc import mypyc_attr
from kvcore.managers.base import HitQuery, SingleTypeKVCacheManager
from kvcore.types import HitBlocks, KVCacheBlock, KVRequest


@mypyc_attr(allow_interpreted_subclasses=True)  # see SingleTypeKVCacheManager
class FullAttentionManager(SingleTypeKVCacheManager):
    registers_partial_tail = True
    downward_closed_hits = True
    fine_grained_hits = True

    @classmethod
    def find_longest_cache_hit(cls, query: HitQuery) -> tuple[HitBlocks, int]:
        bs = query.spec.block_size
        max_blocks = query.max_length // bs
        verifier = query.verifier
        if len(query.group_ids) == 1:
            # Hot path: one group, plain dict lookups.  Hashes chain, so the first miss ends it.
            cached = query.pool.cached_blocks_map(query.group_ids[0])
            hits: list[KVCacheBlock] = []
            for h in islice(query.block_hashes, max_blocks):
                block = cached.get(h)
                if block is None:
                    break
                if verifier is not None and not verifier.matches(block.prefix_node, len(hits),
                                                                 bs):
                    query.pool.num_rejected_hits += 1
                    break
                hits.append(block)
            out: HitBlocks = [hits]
        else:
            out = [[] for _ in query.group_ids]
            for i in range(min(max_blocks, len(query.block_hashes))):
                found = query.lookup(i)
                if found is None:
                    break
                for blocks, block in zip(out, found):
                    blocks.append(block)
        hit_length = len(out[0]) * bs
        alignment = query.alignment_tokens
        units = query.unit_hashes
        if units is not None and alignment < bs:
            # Partial-block hits: the longest hash boundary cached inside the first block the
            # run of full blocks did not reach (a partial entry: its block holds that prefix).
            scale = bs // alignment
            first = len(out[0]) * scale
            for j in range(min(first + scale - 1, query.max_length // alignment, len(units)) - 1,
                           first - 1, -1):
                found = query.lookup_unit(j)
                if found is not None:
                    for blocks, block in zip(out, found):
                        blocks.append(block)
                    hit_length = (j + 1) * alignment
                    break
        if query.drop_last and hit_length:
            # EAGLE: the draft model recomputes the last block (one hash unit when hits may
            # end inside a block: the tail block's KV still covers the shorter hit).
            hit_length -= alignment if alignment < bs else bs
        if alignment != bs:
            hit_length -= hit_length % alignment
        if -(-hit_length // bs) != len(out[0]):
            for blocks in out:
                del blocks[-(-hit_length // bs):]
        return out, hit_length

    def cache_partial_tail(self, request: KVRequest, num_tokens: int) -> None:
        """With blocks larger than the hash block, vLLM registers the prompt's last hash
        boundary inside a block (once ``num_tokens`` reach it) as a partial entry."""
        hbs = self.hash_block_size
        limit = request.num_prompt_tokens if self.use_eagle else request.num_prompt_tokens - 1
        # Only a hashed boundary (lookahead hashes wait for the tokens after it).
        boundary = min(limit // hbs, len(request.block_hashes)) * hbs
        if boundary == 0 or boundary > num_tokens or boundary % self.block_size == 0:
            return
        blocks = self.req_to_blocks.get(request.request_id)
        idx = boundary // self.block_size
        if blocks is None or idx >= len(blocks):
            return
        self.pool.cache_partial_block(request, blocks[idx], boundary, hbs, self.group_id)

    # Nothing ever leaves a full-attention window (releases_blocks is False).
    def get_num_freeable_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> int:
        return 0

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        return None
