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
from kvcore.blocks import BlockHash, KVCacheBlock
from kvcore.managers.base import HitBlocks, HitQuery, ManagerContext, SingleTypeKVCacheManager
from kvcore.request import RequestLike
from kvcore.specs import KVCacheSpec


@mypyc_attr(allow_interpreted_subclasses=True)  # see SingleTypeKVCacheManager
class MambaManager(SingleTypeKVCacheManager):
    allows_null_blocks = True
    releases_blocks = True
    drops_eagle_block = False  # draft models have no state layers: the hit is kept whole

    def __init__(self, spec: KVCacheSpec, group_id: int, ctx: ManagerContext) -> None:
        super().__init__(spec, group_id, ctx)
        self.cached_this_step: set[BlockHash] = set()  # hashes cached since new_step()

    @classmethod
    def find_longest_cache_hit(cls, query: HitQuery) -> tuple[HitBlocks, int]:
        bs = query.spec.block_size
        alignment = query.alignment_tokens
        null = query.pool.null_block
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
        return super().get_num_blocks_to_allocate(request_id, num_tokens, new_computed_blocks,
                                                  total_computed_tokens, max_blocks)

    def cache_blocks(self, request: RequestLike, num_tokens: int) -> None:
        before = self.num_cached_block.get(request.request_id, 0)
        super().cache_blocks(request, num_tokens)
        after = self.num_cached_block.get(request.request_id, 0)
        blocks = self.req_to_blocks.get(request.request_id, [])
        for block in blocks[before:after]:
            if not block.is_null and block.block_hash is not None:
                self.cached_this_step.add(block.block_hash)

    def new_step(self) -> None:
        self.cached_this_step.clear()

    def step_state(self) -> frozenset[BlockHash]:
        return frozenset(self.cached_this_step)
