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


# -- manager-level factories ---------------------------------------------------------------------

def full_spec(block_size: int = 4, **kw: object) -> object:
    import torch

    from kvcore.specs import FullAttentionSpec

    return FullAttentionSpec(block_size=block_size, num_kv_heads=2, head_size=8,
                             dtype=torch.float16, **kw)  # type: ignore[arg-type]


def swa_spec(window: int, block_size: int = 4) -> object:
    import torch

    from kvcore.specs import SlidingWindowSpec

    return SlidingWindowSpec(block_size=block_size, num_kv_heads=2, head_size=8,
                             dtype=torch.float16, sliding_window=window)


def make_config(*specs: object, num_blocks: int = 16) -> object:
    from kvcore.specs import KVCacheConfig, KVCacheGroup

    if not specs:
        specs = (full_spec(),)
    return KVCacheConfig(num_blocks=num_blocks, groups=tuple(
        KVCacheGroup((f"layer{i}",), s) for i, s in enumerate(specs)))  # type: ignore[arg-type]


def make_manager(*specs: object, num_blocks: int = 16, max_model_len: int = 1024,
                 **kwargs: object) -> object:
    from kvcore.manager import KVCacheManager

    return KVCacheManager(make_config(*specs, num_blocks=num_blocks), max_model_len,  # type: ignore[arg-type]
                          **kwargs)  # type: ignore[arg-type]


def admit(manager: object, request: object, num_new_tokens: int | None = None) -> object:
    """get_computed_blocks + allocate_slots for a new request, as a scheduler does; advances
    ``num_computed_tokens`` on success.  Returns the allocate_slots result."""
    blocks, hit = manager.get_computed_blocks(request)  # type: ignore[attr-defined]
    n = request.num_tokens - hit if num_new_tokens is None else num_new_tokens  # type: ignore[attr-defined]
    out = manager.allocate_slots(request, n, hit, blocks)  # type: ignore[attr-defined]
    if out is not None:
        request.num_computed_tokens += hit + n  # type: ignore[attr-defined]
    return out


def decode(manager: object, request: object, token: int) -> object:
    """Append one sampled token and allocate its slot (one decode step)."""
    request.append_output_token_ids(token)  # type: ignore[attr-defined]
    out = manager.allocate_slots(request, 1)  # type: ignore[attr-defined]
    if out is not None:
        request.num_computed_tokens += 1  # type: ignore[attr-defined]
    return out


def manager_snapshot(manager: object) -> tuple[object, ...]:
    """Pool snapshot plus every request's block tables and cached watermarks."""
    coord = manager.coordinator  # type: ignore[attr-defined]
    tables = tuple(
        tuple(sorted((rid, tuple(b.block_id for b in blocks)) for rid, blocks in m.req_to_blocks.items()))
        for m in coord.managers)
    cached = tuple(tuple(sorted(m.num_cached_block.items())) for m in coord.managers)
    return (pool_snapshot(coord.pool), tables, cached, tuple(sorted(manager.requests())))  # type: ignore[attr-defined]
