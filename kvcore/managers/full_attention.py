"""Full attention: a hit is the longest run of leading cached blocks; nothing is freed early."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import islice

from kvcore.block_pool import BlockPool
from kvcore.blocks import BlockHash
from kvcore.managers.base import HitBlocks, SingleTypeKVCacheManager, lookup
from kvcore.specs import KVCacheSpec


class FullAttentionManager(SingleTypeKVCacheManager):
    @classmethod
    def find_longest_cache_hit(
        cls,
        block_hashes: Sequence[BlockHash],
        max_length: int,
        group_ids: Sequence[int],
        pool: BlockPool,
        spec: KVCacheSpec,
        alignment_tokens: int,
        token_ids: Sequence[int] | None = None,
    ) -> tuple[HitBlocks, int]:
        bs = spec.block_size
        max_blocks = max_length // bs
        if len(group_ids) == 1 and token_ids is None:
            # Hot path: one group, plain dict lookups.  Hashes chain, so the first miss ends it.
            cached = pool.cached_blocks_map(group_ids[0])
            hits = []
            for h in islice(block_hashes, max_blocks):
                block = cached.get(h)
                if block is None:
                    break
                hits.append(block)
            out: HitBlocks = [hits]
        else:
            out = [[] for _ in group_ids]
            for i, h in enumerate(islice(block_hashes, max_blocks)):
                found = lookup(pool, h, group_ids, token_ids, i * bs, bs)
                if found is None:
                    break
                for blocks, block in zip(out, found):
                    blocks.append(block)
        hit_length = len(out[0]) * bs
        if alignment_tokens != bs:
            hit_length -= hit_length % alignment_tokens
            for blocks in out:
                del blocks[-(-hit_length // bs):]
        return out, hit_length

    # Nothing ever leaves a full-attention window (releases_blocks is False).
    def get_num_freeable_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> int:
        return 0

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        return None
