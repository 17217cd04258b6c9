"""Cross attention (encoder-decoder): blocks for the encoder output, never shared through the
prefix cache.

As vLLM's ``CrossAttentionManager``: a request's table is sized by ``num_encoder_tokens``
(``cdiv(num_encoder_tokens, block_size)`` blocks) and grows to it whenever an allocation passes
it — vLLM's scheduler passes it once, when the encoder input is scheduled, and 0 on every later
step, so the table is allocated at admission and kept until the request is freed or preempted
(then released with its other groups, tail first).  It takes part in no prefix hit, caches
nothing (so publishes no event) and gets no blocks for tokens a KV connector computed.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvcore._mypyc import mypyc_attr
from kvcore.managers.base import HitQuery, SingleTypeKVCacheManager
from kvcore.types import HitBlocks, KVCacheBlock


@mypyc_attr(allow_interpreted_subclasses=True)  # see SingleTypeKVCacheManager
class CrossAttentionManager(SingleTypeKVCacheManager):
    # (Sized by the encoder tokens: CrossAttentionSpec.reads_encoder.)

    @classmethod
    def find_longest_cache_hit(cls, query: HitQuery) -> tuple[HitBlocks, int]:
        return [[] for _ in query.group_ids], 0

    def add_computed_blocks(self, request_id: str, new_computed_blocks: Sequence[KVCacheBlock],
                            num_total_computed_tokens: int) -> None:
        """A new request's decoder hit or external tokens give this group nothing: its table
        starts empty and no block is marked cached (vLLM's manager records none either)."""
        self.req_to_blocks.setdefault(request_id, [])
