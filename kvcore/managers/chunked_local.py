"""Chunked local attention (Llama-4 style): a token attends only to the tokens of its own
``attention_chunk_size``-aligned chunk, so blocks wholly before the current chunk are null in a
hit and released as the request crosses chunk boundaries.

The chunk size need not be a multiple of the block size.  A hit of ``L`` tokens is valid when
every block from the one holding ``L``'s chunk start up to ``L`` is a real cached block; when the
chunk start falls inside a block, that block is needed too (it holds the start of the chunk), and
when it is missing the hit moves back into the previous chunk, whose blocks are then needed.
"""

from __future__ import annotations

from kvcore._mypyc import mypyc_attr
from kvcore.errors import InvalidArgumentError
from kvcore.managers.base import HitQuery, ManagerContext, SingleTypeKVCacheManager
from kvcore.specs import ChunkedLocalAttentionSpec, KVCacheSpec
from kvcore.types import HitBlocks, KVCacheBlock


@mypyc_attr(allow_interpreted_subclasses=True)  # see SingleTypeKVCacheManager
class ChunkedLocalAttentionManager(SingleTypeKVCacheManager):
    allows_null_blocks = True
    releases_blocks = True

    def __init__(self, spec: KVCacheSpec, group_id: int, ctx: ManagerContext) -> None:
        assert isinstance(spec, ChunkedLocalAttentionSpec)
        super().__init__(spec, group_id, ctx)
        if self.alignment_tokens != self.block_size:
            raise InvalidArgumentError(
                "chunked local attention needs every group to use the same block size")
        if self.use_eagle:
            raise InvalidArgumentError(
                f"use_eagle is not supported with chunked local attention (nor by vLLM): group "
                f"{group_id} would drop a hit's last block, which can move it into another "
                "chunk (leave the group out of eagle_groups)")
        self.attention_chunk_size = spec.attention_chunk_size

    @classmethod
    def find_longest_cache_hit(cls, query: HitQuery) -> tuple[HitBlocks, int]:
        spec = query.spec
        assert isinstance(spec, ChunkedLocalAttentionSpec)
        bs = spec.block_size
        chunk = spec.attention_chunk_size
        end = min(query.max_length // bs, len(query.block_hashes))  # candidate hit, in blocks
        known = end  # blocks [known, end) are cached (found[i - known])
        found: list[list[KVCacheBlock]] = []
        while True:
            first = end * bs // chunk * chunk // bs  # the block holding the chunk start
            scanned: list[list[KVCacheBlock]] = []
            miss = -1
            for i in range(first, known):
                hit = query.lookup(i)
                if hit is None:
                    miss = i
                    break
                scanned.append(hit)
            if miss < 0:
                found = scanned + found
                known = min(first, known)
                break
            # The chunk's blocks up to `miss` are cached; the hit can end there at the latest,
            # which may put it in an earlier chunk with blocks of its own to check.
            found = scanned
            end = miss
            known = first
        null = query.pool.null_block
        out: HitBlocks = []
        for g in range(len(query.group_ids)):
            blocks = [null] * known
            blocks.extend(f[g] for f in found[:end - known])
            out.append(blocks)
        return out, end * bs

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return num_computed_tokens // self.attention_chunk_size * self.attention_chunk_size
