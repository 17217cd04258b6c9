"""Sliding-window attention (window ``w``: a token sees itself and the ``w - 1`` before it).

A hit needs only the last ``cdiv(w - 1, block_size)`` blocks before the hit boundary, so the
search runs right to left for the right-most run of that many contiguous cached blocks; earlier
positions become the null block.  Blocks wholly outside the window are released as the request
advances.
"""

from __future__ import annotations

from kvcore._mypyc import mypyc_attr
from kvcore.managers.base import HitBlocks, HitQuery, ManagerContext, SingleTypeKVCacheManager, cdiv
from kvcore.specs import KVCacheSpec, SlidingWindowSpec


@mypyc_attr(allow_interpreted_subclasses=True)  # see SingleTypeKVCacheManager
class SlidingWindowManager(SingleTypeKVCacheManager):
    allows_null_blocks = True
    releases_blocks = True

    def __init__(self, spec: KVCacheSpec, group_id: int, ctx: ManagerContext) -> None:
        assert isinstance(spec, SlidingWindowSpec)
        super().__init__(spec, group_id, ctx)
        self.sliding_window = spec.sliding_window

    @classmethod
    def find_longest_cache_hit(cls, query: HitQuery) -> tuple[HitBlocks, int]:
        spec = query.spec
        assert isinstance(spec, SlidingWindowSpec)
        bs = spec.block_size
        alignment = query.alignment_tokens
        drop = query.drop_last  # EAGLE: find one more block, then drop it
        need = _contiguous_blocks(spec.sliding_window, bs, drop)
        max_blocks = min(query.max_length // bs, len(query.block_hashes))
        null = query.pool.null_block
        out: HitBlocks = [[null] * max_blocks for _ in query.group_ids]
        run = 0
        matched = False
        for i in range(max_blocks - 1, -1, -1):
            found = query.lookup(i)
            if found is None:
                run = 0
                continue
            if run == 0 and bs != alignment and (i if drop else i + 1) * bs % alignment:
                continue  # a run must end on an aligned boundary (after the EAGLE drop)
            for blocks, block in zip(out, found):
                blocks[i] = block
            run += 1
            if run >= need:
                for blocks in out:
                    del blocks[i + run:]
                matched = True
                break
        if not matched:
            # No full window anywhere: only a run starting at block 0 is a hit.
            for blocks in out:
                del blocks[run:]
            while bs != alignment and len(out[0]) * bs % alignment:
                for blocks in out:
                    blocks.pop()
        if drop and out[0]:
            for blocks in out:
                blocks.pop()
            while bs != alignment and len(out[0]) * bs % alignment:
                for blocks in out:
                    blocks.pop()
        return out, len(out[0]) * bs

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return max(0, num_computed_tokens - self.sliding_window + 1)

    def cache_mask(self, start_block: int, end_block: int) -> list[bool] | None:
        # With hybrid alignment (a hit must end on a multiple of alignment_tokens), only the
        # `need` blocks before each aligned boundary can ever be part of a hit (under EAGLE:
        # the run ends one block past the boundary).
        bs = self.block_size
        if self.alignment_tokens == bs or self.alignment_tokens % bs:
            return None
        need = _contiguous_blocks(self.sliding_window, bs, self.use_eagle)
        per_segment = self.alignment_tokens // bs
        if need >= per_segment:
            return None
        shift = 1 if self.use_eagle else 0
        return [i >= shift and (i - shift) % per_segment >= per_segment - need
                for i in range(start_block, end_block)]


def _contiguous_blocks(window: int, block_size: int, drop_last: bool) -> int:
    """Cached blocks a hit needs before its boundary (one more when EAGLE drops the last)."""
    return cdiv(window - 1, block_size) + (1 if drop_last else 0)
