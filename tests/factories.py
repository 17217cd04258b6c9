"""Factory helpers shared by tests (``make_request``, ``make_manager``, ...) and whole-state
snapshots for "a failed call changes nothing" assertions."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TypedDict

import pytest
import torch

from kvcore import Request
from kvcore.block_pool import BlockPool
from kvcore.hashing import BlockHasher, Seed
from kvcore.manager import KVCacheManager
from kvcore.managers import ManagerClasses
from kvcore.request import RequestBlockHasher
from kvcore.specs import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroup,
    KVCacheSpec,
    SlidingWindowSpec,
)
from kvcore.testing.snapshot import manager_snapshot, pool_snapshot, scheduler_snapshot
from kvcore.types import KVCacheBlock, KVCacheBlocks, MultiModalItem

if TYPE_CHECKING:  # annotations are not evaluated at run time, so Python 3.10 needs no import
    from typing_extensions import Unpack

__all__ = ["ManagerOptions", "PoolOptions", "RequestOptions", "admit", "decode", "full_spec",
           "ids", "make_config", "make_manager", "make_pool", "make_request", "manager_snapshot",
           "pool_snapshot", "run_main", "scheduler_snapshot", "swa_spec"]


class PoolOptions(TypedDict, total=False):
    """Keyword options of :class:`BlockPool`."""

    enable_caching: bool
    num_groups: int
    enable_events: bool
    verify_hits: bool


class RequestOptions(TypedDict, total=False):
    """Keyword options of :class:`Request` (besides ``block_hasher``)."""

    max_tokens: int | None
    cache_salt: str | None
    lora_name: str | None
    mm_items: Sequence[MultiModalItem]
    skip_reading_prefix_cache: bool
    eos_token_id: int | None
    ignore_eos: bool
    stop_token_ids: Sequence[int]
    arrival_time: float
    sampling_params: object


class ManagerOptions(TypedDict, total=False):
    """Keyword options of :class:`KVCacheManager` (besides config and ``max_model_len``)."""

    enable_caching: bool
    hash_algo: str
    hash_seed: Seed
    verify_hits: bool
    enable_events: bool
    log_stats: bool
    max_num_batched_tokens: int | None
    manager_classes: ManagerClasses | None
    block_hasher: BlockHasher | None
    use_eagle: bool
    eagle_groups: tuple[int, ...] | None
    num_hash_lookahead_tokens: int
    eagle_junction_tail: bool
    fast_path: bool


def make_pool(num_blocks: int = 16, **kwargs: Unpack[PoolOptions]) -> BlockPool:
    return BlockPool(num_blocks, **kwargs)


def make_request(request_id: str, token_ids: Sequence[int], block_size: int = 4, *,
                 algorithm: str = "xxh3_128", seed: Seed = None,
                 **kwargs: Unpack[RequestOptions]) -> Request:
    hasher = RequestBlockHasher(block_size, BlockHasher(algorithm, seed))
    return Request(request_id, list(token_ids), block_hasher=hasher, **kwargs)


def ids(blocks: Sequence[KVCacheBlock]) -> list[int]:
    return [b.block_id for b in blocks]


# -- manager-level factories ---------------------------------------------------------------------

def full_spec(block_size: int = 4, *, num_kv_heads: int = 2, head_size: int = 8,
              dtype: torch.dtype = torch.float16) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=block_size, num_kv_heads=num_kv_heads,
                             head_size=head_size, dtype=dtype)


def swa_spec(window: int, block_size: int = 4, *, num_kv_heads: int = 2, head_size: int = 8,
             dtype: torch.dtype = torch.float16) -> SlidingWindowSpec:
    return SlidingWindowSpec(block_size=block_size, num_kv_heads=num_kv_heads,
                             head_size=head_size, dtype=dtype, sliding_window=window)


def make_config(*specs: KVCacheSpec, num_blocks: int = 16) -> KVCacheConfig:
    if not specs:
        specs = (full_spec(),)
    return KVCacheConfig(num_blocks=num_blocks, groups=tuple(
        KVCacheGroup((f"layer{i}",), s) for i, s in enumerate(specs)))


def make_manager(*specs: KVCacheSpec, num_blocks: int = 16, max_model_len: int = 1024,
                 **kwargs: Unpack[ManagerOptions]) -> KVCacheManager:
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


def run_main(main: Callable[[list[str]], int], capsys: pytest.CaptureFixture[str],
             *argv: str) -> tuple[int, str, str]:
    """Run a command-line ``main`` in-process: its exit status (argparse's ``SystemExit``
    included), stdout and stderr."""
    try:
        rc = main(list(argv))
    except SystemExit as exc:  # argparse
        rc = int(exc.code or 0)
    out, err = capsys.readouterr()
    return rc, out, err
