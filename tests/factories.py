"""Factory helpers shared by tests (``make_request``, ``make_pool``, ...)."""

from __future__ import annotations

from collections.abc import Sequence

from kvcore import BlockHasher, BlockPool, Request, RequestBlockHasher


def make_pool(num_blocks: int = 16, **kwargs: object) -> BlockPool:
    return BlockPool(num_blocks, **kwargs)  # type: ignore[arg-type]


def make_request(request_id: str, token_ids: Sequence[int], block_size: int = 4, *,
                 algorithm: str = "xxh3_128", seed: object = None, **kwargs: object) -> Request:
    hasher = RequestBlockHasher(block_size, BlockHasher(algorithm, seed))  # type: ignore[arg-type]
    return Request(request_id, list(token_ids), block_hasher=hasher, **kwargs)  # type: ignore[arg-type]


def ids(blocks: Sequence[object]) -> list[int]:
    return [b.block_id for b in blocks]  # type: ignore[attr-defined]


def pool_snapshot(pool: BlockPool) -> tuple[object, ...]:
    """Everything observable about a pool, for "changes nothing" assertions."""
    blocks = tuple((b.block_id, b.ref_cnt, b.block_hash, b.group_id, b.cached_token_ids,
                    None if b.prev_free is None else b.prev_free.block_id,
                    None if b.next_free is None else b.next_free.block_id) for b in pool.blocks)
    maps = tuple(tuple(sorted((h, b.block_id) for h, b in pool.iter_cached(g)))
                 for g in range(pool.num_groups))
    return (tuple(ids(list(pool.free_queue))), len(pool.free_queue), blocks, maps,
            tuple(pool._events), pool.num_evicted_blocks)
