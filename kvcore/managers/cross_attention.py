"""Cross attention (encoder-decoder): blocks for the encoder output, allocated once per request
from ``num_encoder_tokens`` and never shared through the prefix cache."""

from __future__ import annotations

from kvcore._mypyc import mypyc_attr
from kvcore.managers.base import HitBlocks, HitQuery, SingleTypeKVCacheManager


@mypyc_attr(allow_interpreted_subclasses=True)  # see SingleTypeKVCacheManager
class CrossAttentionManager(SingleTypeKVCacheManager):
    uses_encoder_tokens = True

    @classmethod
    def find_longest_cache_hit(cls, query: HitQuery) -> tuple[HitBlocks, int]:
        return [[] for _ in query.group_ids], 0
