"""Full attention: a hit is the longest run of leading cached blocks; nothing is freed early."""

from __future__ import annotations

from itertools import islice

from kvcore.managers.base import HitBlocks, HitQuery, SingleTypeKVCacheManager


class FullAttentionManager(SingleTypeKVCacheManager):
    @classmethod
    def find_longest_cache_hit(cls, query: HitQuery) -> tuple[HitBlocks, int]:
        bs = query.spec.block_size
        max_blocks = query.max_length // bs
        if len(query.group_ids) == 1 and query.verifier is None:
            # Hot path: one group, plain dict lookups.  Hashes chain, so the first miss ends it.
            cached = query.pool.cached_blocks_map(query.group_ids[0])
            hits = []
            for h in islice(query.block_hashes, max_blocks):
                block = cached.get(h)
                if block is None:
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
        if alignment != bs:
            hit_length -= hit_length % alignment
            for blocks in out:
                del blocks[-(-hit_length // bs):]
        return out, hit_length

    # Nothing ever leaves a full-attention window (releases_blocks is False).
    def get_num_freeable_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> int:
        return 0

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        return None
