"""Factory helpers shared by tests (``make_request``, ``make_manager``, ...) and whole-state
snapshots for "a failed call changes nothing" assertions."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kvcore import BlockHasher, BlockPool, KVCacheBlock, Request, RequestBlockHasher
from kvcore.hashing import Seed
from kvcore.manager import KVCacheBlocks, KVCacheManager
from kvcore.specs import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroup,
    KVCacheSpec,
    SlidingWindowSpec,
)
from kvcore.testing.snapshot import manager_snapshot, pool_snapshot, scheduler_snapshot

__all__ = ["admit", "decode", "full_spec", "ids", "make_config", "make_manager", "make_pool",
           "make_request", "manager_snapshot", "pool_snapshot", "scheduler_snapshot", "swa_spec"]


def make_pool(num_blocks: int = 16, **kwargs: Any) -> BlockPool:
    return BlockPool(num_blocks, **kwargs)


def make_request(request_id: str, token_ids: Sequence[int], block_size: int = 4, *,
                 algorithm: str = "xxh3_128", seed: Seed = None, **kwargs: Any) -> Request:
    hasher = RequestBlockHasher(block_size, BlockHasher(algorithm, seed))
    return Request(request_id, list(token_ids), block_hasher=hasher, **kwargs)


def ids(blocks: Sequence[KVCacheBlock]) -> list[int]:
    return [b.block_id for b in blocks]


# -- manager-level factories ---------------------------------------------------------------------

def full_spec(block_size: int = 4, **kw: Any) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=block_size, num_kv_heads=2, head_size=8,
                             dtype=torch.float16, **kw)


def swa_spec(window: int, block_size: int = 4) -> SlidingWindowSpec:
    return SlidingWindowSpec(block_size=block_size, num_kv_heads=2, head_size=8,
                             dtype=torch.float16, sliding_window=window)


def make_config(*specs: KVCacheSpec, num_blocks: int = 16) -> KVCacheConfig:
    if not specs:
        specs = (full_spec(),)
    return KVCacheConfig(num_blocks=num_blocks, groups=tuple(
        KVCacheGroup((f"layer{i}",), s) for i, s in enumerate(specs)))


def make_manager(*specs: KVCacheSpec, num_blocks: int = 16, max_model_len: int = 1024,
                 **kwargs: Any) -> KVCacheManager:
    return KVCacheManager(make_config(*specs, num_blocks=num_blocks), max_model_len, **kwargs)


def admit(manager: KVCacheManager, request: Request,
          num_new_tokens: int | None = None) -> KVCacheBlocks | None:
    """get_computed_blocks + allocate_slots for a new request, as a scheduler does; on success
    records the lookup in the prefix-cache stats and advances ``num_computed_tokens``.  Returns
    the allocate_slots result."""
    blocks, hit = manager.get_computed_blocks(request)
    n = request.num_tokens - hit if num_new_tokens is None else num_new_tokens
    out = manager.allocate_slots(request, n, hit, blocks)
    if out is not None:
        manager.record_prefix_cache_stats(request, hit)
        request.num_computed_tokens += hit + n
    return out


def decode(manager: KVCacheManager, request: Request, token: int) -> KVCacheBlocks | None:
    """Append one sampled token and allocate its slot (one decode step)."""
    request.append_output_token_ids(token)
    out = manager.allocate_slots(request, 1)
    if out is not None:
        request.num_computed_tokens += 1
    return out
