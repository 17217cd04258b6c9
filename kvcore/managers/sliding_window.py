"""Sliding-window attention (window ``w``: a token sees itself and the ``w - 1`` before it).

A hit needs only the last ``cdiv(w - 1, block_size)`` blocks before the hit boundary, so the
search runs right to left for the right-most run of that many contiguous cached blocks; earlier
positions become the null block.  Blocks wholly outside the window (and below the spec's
``extra_retained_tokens`` more) are released as the request advances.  Only blocks a hit can end on are cached (``cache_mask``), sparser still under a
retention interval (``KVCacheConfig.prefix_cache_retention_interval``).
"""

from __future__ import annotations

from kvcore._mypyc import mypyc_attr
from kvcore.managers.base import HitQuery, ManagerContext, SingleTypeKVCacheManager, cdiv
from kvcore.specs import KVCacheSpec, SlidingWindowSpec
from kvcore.types import HitBlocks, KVRequest


@mypyc_attr(allow_interpreted_subclasses=True)  # see SingleTypeKVCacheManager
class SlidingWindowManager(SingleTypeKVCacheManager):
    allows_null_blocks = True
    releases_blocks = True

    def __init__(self, spec: KVCacheSpec, group_id: int, ctx: ManagerContext) -> None:
        assert isinstance(spec, SlidingWindowSpec)
        super().__init__(spec, group_id, ctx)
        self.sliding_window = spec.sliding_window
        self.retained_tokens = spec.retained_tokens  # the window's tokens and the extra ones
        self.retention_interval = ctx.retention_interval
        self.shared_prefix_boundaries = ctx.shared_prefix_boundaries
        self.junction_tail = ctx.eagle_junction_tail and self.use_eagle

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
        # (retained_tokens: sliding_window - 1, plus the spec's extra_retained_tokens.)
        return max(0, num_computed_tokens - self.retained_tokens)

    def get_num_unread_tokens(self, num_computed_tokens: int) -> int:
        return max(0, num_computed_tokens - self.sliding_window + 1)

    def cache_mask(self, request: KVRequest, start_block: int,
                   end_block: int) -> list[bool] | None:
        """Only blocks a hit can end on are cached (vLLM 0.32's reachable-block mask): a hit
        ends on a multiple of the hit alignment (under EAGLE one block past it) and needs the
        ``need`` blocks before that end.  Dense (no retention interval): every aligned end;
        with an interval ``k``: one end per ``k`` tokens; with any interval, also the ends a
        later request can resume at — the prompt's replay boundaries and the shared prefix the
        request's admission found some other group holding (under EAGLE, with
        ``eagle_junction_tail``, also one block below it: a sibling that diverges right after
        the junction cannot peek past it, so its hit ends a block lower)."""
        bs = self.block_size
        align = self.alignment_tokens
        retention = self.retention_interval
        if align % bs or (align == bs and retention is None):  # (the latter: every block)
            return None
        need = _contiguous_blocks(self.sliding_window, bs, self.use_eagle)
        shift = 1 if self.use_eagle else 0
        segment = align if retention is None else retention
        per_segment = segment // bs
        if segment and need >= per_segment:
            return None
        mask = [False] * (end_block - start_block)
        if segment:
            for i in range(start_block, end_block):
                if i >= shift and (i - shift) % per_segment >= per_segment - need:
                    mask[i - start_block] = True
        if retention is not None:
            # (The replay boundaries follow whether any group drops, as vLLM's.)
            boundaries = replay_boundaries(request.num_prompt_tokens, self.replay_alignment,
                                           self.any_eagle)
            shared = self.shared_prefix_boundaries.get(request.request_id, 0)
            if shared:
                boundaries = ((*boundaries, shared, shared - bs) if self.junction_tail
                              else (*boundaries, shared))
            for boundary in boundaries:
                end = boundary // align * align // bs + shift
                for j in range(max(start_block, end - need), min(end_block, end)):
                    mask[j - start_block] = True
        return mask


def replay_boundaries(num_prompt_tokens: int, alignment_tokens: int,
                      use_eagle: bool) -> tuple[int, ...]:
    """Where a later request replaying this prompt can resume (vLLM's ``replay_boundaries``):
    a resend of the same prompt at ``num_prompt_tokens - 1`` (its last token is recomputed);
    under EAGLE, the aligned block below a resend and below a longer sibling's match."""
    if not use_eagle:
        return (num_prompt_tokens - 1,)
    resend = (num_prompt_tokens - 1) // alignment_tokens * alignment_tokens
    extension = num_prompt_tokens // alignment_tokens * alignment_tokens
    return tuple(sorted({max(resend - alignment_tokens, 0),
                         max(extension - alignment_tokens, 0)}))


def _contiguous_blocks(window: int, block_size: int, drop_last: bool) -> int:
    """Cached blocks a hit needs before its boundary (one more when EAGLE drops the last)."""
    return cdiv(window - 1, block_size) + (1 if drop_last else 0)
