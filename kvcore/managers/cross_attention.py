"""Cross attention (encoder-decoder): blocks for the encoder output, allocated once per request
from ``num_encoder_tokens`` and never shared through the prefix cache."""

from __future__ import annotations

from collections.abc import Sequence

from kvcore.block_pool import BlockPool
from kvcore.blocks import BlockHash
from kvcore.managers.base import HitBlocks, SingleTypeKVCacheManager
from kvcore.specs import KVCacheSpec


class CrossAttentionManager(SingleTypeKVCacheManager):
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
        return [[] for _ in group_ids], 0
