"""Chunked local attention (Llama-4 style): tokens attend only within their
``attention_chunk_size``-aligned chunk, so blocks before the current chunk are null in a hit and
released as the request crosses chunk boundaries."""

from __future__ import annotations

from collections.abc import Sequence

from kvcore.block_pool import BlockPool
from kvcore.blocks import BlockHash
from kvcore.errors import InvalidArgumentError
from kvcore.managers.base import HitBlocks, SingleTypeKVCacheManager, lookup
from kvcore.specs import ChunkedLocalAttentionSpec, KVCacheSpec


class ChunkedLocalAttentionManager(SingleTypeKVCacheManager):
    allows_null_blocks = True
    releases_blocks = True

    def __init__(self, spec: KVCacheSpec, pool: BlockPool, group_id: int, *, enable_caching: bool,
                 hash_block_size: int, alignment_tokens: int) -> None:
        assert isinstance(spec, ChunkedLocalAttentionSpec)
        super().__init__(spec, pool, group_id, enable_caching=enable_caching,
                         hash_block_size=hash_block_size, alignment_tokens=alignment_tokens)
        if self.alignment_tokens != self.block_size:
            raise InvalidArgumentError(
                "chunked local attention needs every group to use the same block size")
        self.attention_chunk_size = spec.attention_chunk_size

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
        assert isinstance(spec, ChunkedLocalAttentionSpec)
        bs = spec.block_size
        max_blocks = max_length // bs
        chunk_start = max_length // spec.attention_chunk_size * spec.attention_chunk_size
        first = chunk_start // bs
        out: HitBlocks = [[pool.null_block] * first for _ in group_ids]
        for i in range(first, max_blocks):
            found = lookup(pool, block_hashes[i], group_ids, token_ids, i * bs, bs)
            if found is None:
                break
            for blocks, block in zip(out, found):
                blocks.append(block)
        return out, len(out[0]) * bs

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return num_computed_tokens // self.attention_chunk_size * self.attention_chunk_size
