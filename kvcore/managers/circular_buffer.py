"""Circular buffers (vLLM's ``CircularBufferManager``): one scratch block per request.

The block is a ring of ``block_size`` slots that a compressor rewrites in place (DeepSeek-V4's
CSA compressor ring holds the raw keys of the token group it is still compressing).  As in
vLLM, a request takes its ring at its first allocation — fresh, with new tokens, or for tokens a
KV connector computed — and holds it, whatever its length, until it is freed or preempted; the
ring is never cached, never part of a hit (a prefix hit of the other groups gives this group
nothing) and never released early.  The coordinator asks this type for its count on every
allocation (``counts_own_growth``): one block until the request holds its ring, then none.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from kvcore._mypyc import mypyc_attr
from kvcore.managers.base import HitQuery, SingleTypeKVCacheManager
from kvcore.types import HitBlocks, KVCacheBlock


@mypyc_attr(allow_interpreted_subclasses=True)  # see SingleTypeKVCacheManager
class CircularBufferManager(SingleTypeKVCacheManager):
    counts_own_growth = True
    max_table_blocks = 1

    @classmethod
    def find_longest_cache_hit(cls, query: HitQuery) -> tuple[HitBlocks, int]:
        return [[] for _ in query.group_ids], 0

    def _claim(self, request_id: str) -> list[KVCacheBlock]:
        """Take the request's ring unless it holds it; return what was taken."""
        blocks = self.req_to_blocks.get(request_id)
        if blocks:
            return []
        new = self.pool.get_new_blocks(1)
        self.req_to_blocks[request_id] = list(new)
        return new

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int,
                                   new_computed_blocks: Sequence[KVCacheBlock],
                                   total_computed_tokens: int, max_blocks: int | None = None) -> int:
        return 0 if self.req_to_blocks.get(request_id) else 1

    def count_state_blocks(self, request_id: str, num_tokens: int,
                           new_computed_blocks: Sequence[KVCacheBlock], total_computed_tokens: int,
                           prefill_end: int, record: bool) -> int:
        return 0 if self.req_to_blocks.get(request_id) else 1

    def add_computed_blocks(self, request_id: str, new_computed_blocks: Sequence[KVCacheBlock],
                            num_total_computed_tokens: int) -> None:
        """A prefix hit brings this group nothing (vLLM's manager records nothing either)."""

    def allocate_external_computed_blocks(self, request_id: str, num_local_computed_tokens: int,
                                          num_external_computed_tokens: int) -> None:
        self._claim(request_id)

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[KVCacheBlock]:
        return self._claim(request_id)

    def get_num_freeable_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> int:
        return 0

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """The ring is held until the request is freed."""

    def uncache_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Nothing of the ring is ever cached."""

    def first_token_in(self, request_id: str, block_ids: Collection[int]) -> int | None:
        """The ring holds keys of the request's latest tokens, not of a fixed position: a
        failed ring is a failure from the start."""
        ring = self.req_to_blocks.get(request_id)
        return 0 if ring and ring[0].block_id in block_ids else None

    def can_resume(self, request_id: str, num_tokens: int) -> bool:
        """The ring holds the keys of the latest tokens, not those before ``num_tokens``."""
        return False
